"""Training configuration: defaults, per-model defaults, a TOML file, command-line flags.

Precedence, lowest to highest: the built-in defaults below, the model's recommended
settings (``mpidl.engine.models.MODEL_DEFAULTS``), the ``--config FILE.toml`` values, the
command-line flags. A config file is flat ``key = value`` lines whose keys are the flag
names (``batch_size`` or ``batch-size``); an unknown key, a value of the wrong type or
out of range is a ``ConfigError`` naming the key (and the file), which the command line
turns into one line and exit status 2.
"""

import math
import os
from types import SimpleNamespace

from mpidl.errors import ConfigError
from mpidl.options import Option

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib


def resume_mode(value):
    """``--resume``'s value: False (a new run), True (the bare flag, or ``resume = true``
    in a config file) or "auto"; both resume from the newest usable checkpoint and start
    from scratch when there is none. ValueError for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    raise ValueError("expects no value or 'auto' on the command line, true, false or "
                     f"\"auto\" in a config file; got {value!r}")


OPTIONS = [
    # model and data
    Option("model", str, "mlp", "network to train (see `mpidl info --models`); its "
           "recommended optimizer, lr, schedule, batch size and epochs become the defaults; "
           "or FILE.py:FUNC, your own model: FUNC(input_shape, num_classes, rng, dtype) "
           "returns an mpidl Layer", "model and data", metavar="NAME|FILE.py:FUNC"),
    Option("dataset", str, "fashion-mnist", "fashion-mnist, mnist, cifar10, digits "
           "(scikit-learn), synthetic, or text (characters of UTF-8 text, for gpt-tiny)",
           "model and data"),
    Option("data_dir", str, None, "folder holding the dataset files (default: "
           "/usr/share/datasets/<dataset>, or $MPIDL_DATA_DIR/<dataset>); for --dataset "
           "text a UTF-8 file or a folder of them (default: Debian's fortunes, "
           "/usr/share/games/fortunes)", "model and data", metavar="DIR"),
    Option("dropout", float, None, "dropout probability of the models that have dropout "
           "layers (mlp, cnn, gpt-tiny); default: the model's own (0)", "model and data",
           metavar="P"),
    Option("layers", int, None, "transformer blocks (gpt-tiny)", "model and data",
           metavar="N"),
    Option("heads", int, None, "attention heads per block; must divide --width (gpt-tiny)",
           "model and data", metavar="H"),
    Option("width", int, None, "model width: embedding and residual stream (gpt-tiny)",
           "model and data", metavar="D"),
    Option("context", int, None, "characters per training window and the longest sequence "
           "the model takes (gpt-tiny, --dataset text)", "model and data", metavar="T"),
    Option("tie_weights", bool, False, "the output layer uses the token embedding's weight "
           "(gpt-tiny)", "model and data"),
    Option("init", str, None, "start from the weights of a model saved by mpidl train "
           "(--save); the network is rebuilt as it was saved (model, input shape, classes)",
           "model and data", metavar="FILE.npz"),
    Option("limit_train", int, None, "train on the first N training samples only (quick "
           "tests)", "model and data", metavar="N"),
    Option("limit_test", int, None, "evaluate on the first N test samples only",
           "model and data", metavar="N"),
    Option("drop_last", bool, False, "drop the last incomplete global batch of each epoch "
           "instead of padding it by wrapping around to the epoch's first samples",
           "model and data"),
    # optimization
    Option("epochs", int, 10, "number of passes over the training set"),
    Option("batch_size", int, 128, "mini-batch size per rank (the global batch is this "
           "times the number of training ranks)", metavar="B"),
    Option("eval_batch_size", int, 500, "batch size for evaluating the test set",
           metavar="B"),
    Option("optimizer", str, "sgd", "sgd, adam or adamw; or lbfgs: full-batch L-BFGS "
           "(one process, or --strategy ps: Sandblaster, servers holding its vectors)",
           choices=("sgd", "adam", "adamw", "lbfgs")),
    Option("lr", float, 0.05, "base learning rate (before --scale-lr and the schedule)"),
    Option("momentum", float, 0.9, "SGD momentum (0 turns it off)"),
    Option("nesterov", bool, False, "use Nesterov momentum with SGD"),
    Option("weight_decay", float, 0.0, "L2 weight decay (decoupled for adamw)",
           metavar="WD"),
    Option("clip_grad_norm", float, None, "clip the gradients to this global L2 norm after "
           "they are synchronized (every layout computes the same norm, to the bit); the "
           "epoch line reports grad_norm and clipped_steps", metavar="MAX",
           check=lambda v: None if v > 0 and v < float("inf") else "must be a positive "
           "number"),
    Option("schedule", str, "constant", "learning-rate schedule over the steps: constant, "
           "step, cosine, linear (see the engine's make_schedule); a pipeline schedule "
           "name (gpipe, 1f1b, interleaved[:v], zb) sets --pipeline-schedule; both: "
           "--schedule cosine,1f1b"),
    Option("warmup_epochs", float, 0.0, "linear learning-rate warm-up from ~0 over this many "
           "epochs (fractions allowed)", metavar="E"),
    Option("scale_lr", bool, False, "large-batch rule: multiply lr by the number of "
           "training ranks, with a linear warm-up over --warmup-epochs (1 unless given)"),
    Option("seed", int, 0, "seed for weights, shuffling and dropout; the same seed and rank "
           "count give the same run"),
    Option("device", str, "cpu", "cpu (NumPy) or gpu (CuPy, one GPU per rank by node-local "
           "rank)", choices=("cpu", "gpu")),
    Option("dtype", str, "float32", "float32 or float64 parameters and activations",
           choices=("float32", "float64")),
    Option("fused_optimizer", str, "auto", "optimizer updates on CPU: on (Numba kernels, one "
           "pass over memory per parameter), off (NumPy's sequence of array operations), or "
           "auto (fused when the run makes enough updates to repay loading Numba, about a "
           "second per process). Both give bitwise the same parameters",
           choices=("auto", "on", "off")),
    # outputs
    Option("stall_warning", float, None, "seconds a rank may wait in a collective, a "
           "point-to-point call or the parameter server's protocol before it names the "
           "ranks that have not arrived (default: MPIDL_STALL_WARNING or 60)", "parallelism",
           metavar="S", check=lambda s: None if 0 < s < float("inf") else
           "must be a number of seconds > 0"),
    Option("stall_timeout", float, None, "end the job (exit 1) when such a wait lasts S "
           "seconds, naming who has not arrived (default: MPIDL_STALL_TIMEOUT or 0 = never)",
           "parallelism", metavar="S", check=lambda s: None if 0 <= s < float("inf") else
           "must be a number of seconds >= 0 (0: never)"),
    Option("keep_batch", str, None, "what a run keeps when its number of ranks changes "
           "(an --elastic run that lost a rank, a --resume on more or fewer ranks): global, "
           "the global batch (each rank takes a larger or smaller piece: the same steps and "
           "results as without the change, up to rounding; the default for data "
           "parallelism), or rank, the per-rank batch (the global batch and --scale-lr "
           "follow the ranks; what local SGD and the parameter server always do)",
           "parallelism", choices=(None, "global", "rank")),
    Option("elastic", bool, False, "survive the death of ranks: the survivors shrink the "
           "world and go on from the last commit in memory, the epoch's other samples "
           "dealt over them (needs ULFM: Open MPI 5 started with mpiexec --with-ft ulfm; "
           "data parallelism)", "parallelism"),
    Option("elastic_commit_every", int, 10, "--elastic: keep the state of every K-th "
           "step in memory to go back to (a death repeats at most K-1 steps; each commit "
           "copies the model and optimizer state, about a tenth of a step's time for the "
           "mlp)", "parallelism", metavar="K",
           check=lambda k: None if k >= 1 else "must be at least 1"),
    Option("server_replicas", int, 2, "--elastic with --strategy ps: how many workers "
           "keep the servers' state of the last epoch's end in memory, so that a death "
           "loses only the epoch in progress (default 2: no single death, the first "
           "worker's included, loses it; 0: none kept, a death then goes back to the last "
           "checkpoint on disk, --checkpoint-dir)", "parallelism",
           metavar="R", check=lambda r: None if r >= 0 else "must be at least 0"),
    Option("out_dir", str, None, "folder for this run's outputs (default "
           "runs/<name or date-time>)", "outputs", metavar="DIR"),
    Option("name", str, None, "run name: outputs go to runs/NAME unless --out-dir is given",
           "outputs"),
    Option("metrics", str, None, "append one JSON line per epoch to this file (default "
           "OUT_DIR/metrics.jsonl); the same lines go to stdout", "outputs", metavar="FILE"),
    Option("save", str, None, "save the final model to this .npz file (default "
           "OUT_DIR/model.npz)", "outputs", metavar="FILE"),
    Option("checkpoint_dir", str, None, "folder for checkpoints (default "
           "OUT_DIR/checkpoints); giving it turns checkpoints on", "outputs", metavar="DIR"),
    Option("checkpoint_every", int, 0, "write a checkpoint every K steps and at the end "
           "(0: only at the end, and only when checkpoints are on)", "outputs", metavar="K"),
    Option("keep_checkpoints", int, 3, "keep the newest N checkpoints", "outputs",
           metavar="N"),
    Option("resume", resume_mode, False, "continue from the newest checkpoint in the "
           "checkpoint folder (bitwise the same result as an uninterrupted run), or start "
           "from scratch when it holds none; --resume auto says the same for scripts that "
           "run one command line again and again (slurm/train.sbatch after a requeue). "
           "Config key: resume = true or \"auto\"", "outputs", metavar="auto"),
    Option("progress", bool, True, "no progress bar (rank 0 shows one on stderr by "
           "default; config key: progress = false)", "outputs"),
    Option("verbose", bool, False, "let every rank log, not only rank 0", "outputs"),
]
CORE_OPTIONS = list(OPTIONS)
OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}


def register(options):
    """Add settings that other parts declare (the runtime's schedule, syncs and presets
    list theirs as ``OPTIONS`` of ``mpidl.options.Option``): they become flags,
    config-file keys and, when set, keyword arguments of those parts. The command line
    calls it before parsing; registering the same option twice is harmless."""
    for o in options:
        known = OPTIONS_BY_NAME.get(o.name)
        if known is None:
            OPTIONS.append(o)
            OPTIONS_BY_NAME[o.name] = o
        elif known != o:
            raise ValueError(f"two different settings are both called {o.name!r}")
    return OPTIONS


#: parallelism settings that are not the strategy's (the communicator's own)
NOT_STRATEGY = ("strategy", "stall_warning", "stall_timeout", "elastic",
                "elastic_commit_every", "keep_batch", "server_replicas")


def strategy_kwargs(cfg):
    """The parallelism settings that differ from their defaults, for the strategy."""
    return {o.name: getattr(cfg, o.name) for o in OPTIONS
            if o.group in ("parallelism", "precision") and o.name not in NOT_STRATEGY
            and getattr(cfg, o.name, o.default) != o.default}
#: settings that change which samples a step sees, or where the state of a run lives: a
#: checkpoint only resumes if they match
RESUME_KEYS = ("model", "dataset", "limit_train", "drop_last", "batch_size", "accumulate",
               "seed", "dtype", "optimizer", "dropout", "strategy", "sync", "period",
               "warmup_steps", "precision", "layers", "heads", "width", "context",
               "tie_weights", "sparse_sync", "ps_params")
#: settings that are options of the model builders (passed to the builder when set)
MODEL_OPTIONS = ("dropout", "layers", "heads", "width", "context", "tie_weights")


class TrainConfig(SimpleNamespace):
    """The resolved settings, as attributes (``cfg.lr``); ``to_dict()`` for saving."""

    def to_dict(self):
        return dict(vars(self))


def _check_type(opt, value, where):
    t = opt.type
    if t is resume_mode:
        try:
            return resume_mode(value)
        except ValueError:
            raise ConfigError(f"{where}: {opt.name} must be bool or \"auto\", got "
                              f"{value!r}") from None
    if opt.choices and "on" in opt.choices and isinstance(value, bool):
        return "on" if value else "off"  # overlap = true/false in a config file
    ok = (isinstance(value, bool) if t is bool else
          isinstance(value, int) and not isinstance(value, bool) if t is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if t is float else
          isinstance(value, str))
    if not ok:
        raise ConfigError(f"{where}: {opt.name} must be {t.__name__}, got {value!r}")
    return float(value) if t is float else value


def read_toml(path):
    """A TOML file's table, or one ``ConfigError`` naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start} is "
                          f"0x{e.object[e.start]:02x}); save it as UTF-8") from None


def load_toml(path):
    """The flat ``{key: value}`` table of a TOML config file, keys checked and normalized."""
    table = read_toml(path)
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in OPTIONS_BY_NAME:
            raise ConfigError(f"unknown key {key!r} in config file {path}; valid keys: "
                              f"{', '.join(o.name for o in OPTIONS)}")
        out[name] = _check_type(OPTIONS_BY_NAME[name], value, f"config file {path}")
    return out


def model_defaults(model):
    """The engine's recommended settings for ``model``, restricted to known options."""
    from mpidl.engine.models import MODEL_DEFAULTS, MODELS, is_model_file  # noqa: PLC0415

    if is_model_file(model):  # a model of the user's own: the built-in defaults apply
        return {}
    if model not in MODELS:
        raise ConfigError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    return {k: v for k, v in dict(MODEL_DEFAULTS.get(model, {})).items()
            if k in OPTIONS_BY_NAME}


def resolve(flags=None, config_path=None, use_model_defaults=True):
    """Merge defaults < model defaults < config file < ``flags`` (only the flags given).

    ``flags``: {option name: value} for the flags that were on the command line.
    """
    flags = dict(flags or {})
    for name in flags:
        if name not in OPTIONS_BY_NAME:
            raise ConfigError(f"unknown setting {name!r}")
    from_file = load_toml(config_path) if config_path else {}
    values = {o.name: o.default for o in OPTIONS}
    model = flags.get("model", from_file.get("model", values["model"]))
    if use_model_defaults:
        values.update(model_defaults(model))
    before = dict(values)
    values.update(from_file)
    values.update(flags)
    _shared_flags(values, before, (from_file, flags))
    cfg = TrainConfig(**values)
    cfg.config = os.path.abspath(config_path) if config_path else None
    cfg.given = sorted(set(from_file) | set(flags))  # what the user set explicitly
    validate(cfg)
    return cfg


def _shared_flags(values, before, sources):
    """Settings that share another's flag or are its alias (``Option.shares``/``claims``
    and ``same_as``): ``--schedule cosine,1f1b`` sets the learning-rate schedule and the
    pipeline's (without a learning-rate part the model's default stays, ``before``);
    ``--micro-batches M`` sets ``--accumulate M``. ``sources``: the config file's and the
    flags' values, in that order."""
    def given(name):
        return next((src[name] for src in reversed(sources) if name in src), None)

    for o in OPTIONS:
        if o.shares is not None and given(o.shares) is not None:
            host = given(o.shares)
            parts = [p.strip() for p in str(host).split(",") if p.strip()]
            mine = [p for p in parts if o.claims(p)]
            rest = [p for p in parts if not o.claims(p)]
            if len(mine) > 1 or len(rest) > 1 or not parts:
                raise ConfigError(f"--{_flag(o.shares)} {host!r}: give at most one value of "
                                  f"each kind (--{_flag(o.name)} is the other), e.g. "
                                  "--schedule cosine,1f1b")
            values[o.shares] = rest[0] if rest else before[o.shares]
            if mine:
                own = given(o.name)
                if own is not None and own != mine[0]:
                    raise ConfigError(f"--{_flag(o.shares)} {mine[0]} and --{_flag(o.name)} "
                                      f"{own} disagree: give it once")
                values[o.name] = mine[0]
        if o.same_as is not None:
            v = values.get(o.name)
            if v is None or (o.check is not None and o.check(v)):
                continue  # unset, or a bad value validate reports under its own name
            other = given(o.same_as)
            if other is not None and other != v:
                raise ConfigError(f"--{_flag(o.name)} {v} and --{_flag(o.same_as)} {other} "
                                  "are the same setting: give one of them")
            values[o.same_as] = v


def _flag(name):
    return name.replace("_", "-")


def validate(cfg):
    """Raise ConfigError for a value out of range; one message naming the setting."""
    def bad(name, why):
        raise ConfigError(f"--{name.replace('_', '-')} {why}, got {getattr(cfg, name)!r}")

    for o in OPTIONS:
        v = getattr(cfg, o.name)
        if o.choices and v not in o.choices:
            bad(o.name, f"must be one of {', '.join(str(c) for c in o.choices if c)}")
        why = o.check(v) if o.check is not None and v is not None else None
        if why:
            bad(o.name, why)
    if not 0 < cfg.lr < math.inf:
        bad("lr", "must be positive")
    if cfg.epochs < 1:
        bad("epochs", "must be at least 1")
    for name in ("batch_size", "eval_batch_size"):
        if getattr(cfg, name) < 1:
            bad(name, "must be at least 1")
    if not 0 <= cfg.momentum < 1:
        bad("momentum", "must be in [0, 1)")
    if not 0 <= cfg.weight_decay < math.inf:
        bad("weight_decay", "must be a number >= 0")
    if not 0 <= cfg.warmup_epochs < math.inf:
        bad("warmup_epochs", "must be a number >= 0")
    if not 0 <= cfg.seed < 2 ** 63:
        bad("seed", "must be a whole number >= 0")
    for name in ("limit_train", "limit_test"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            bad(name, "must be at least 1")
    if cfg.checkpoint_every < 0:
        bad("checkpoint_every", "must not be negative (0: only at the end)")
    if cfg.keep_checkpoints < 1:
        bad("keep_checkpoints", "must be at least 1")
    if cfg.dropout is not None and not 0 <= cfg.dropout < 1:
        bad("dropout", "must be in [0, 1)")
    for name in ("layers", "heads", "width", "context"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            bad(name, "must be at least 1")
    if cfg.nesterov and (cfg.optimizer != "sgd" or cfg.momentum == 0):
        bad("nesterov", "needs --optimizer sgd with --momentum > 0")
    precision = getattr(cfg, "precision", "fp32")
    if precision not in (None, "fp32") and cfg.dtype != "float32":
        raise ConfigError(f"--precision {precision} computes in {precision} with float32 "
                          f"master weights, so --dtype {cfg.dtype} has no meaning with it: "
                          "drop --dtype (or use --precision fp32)")
    return cfg

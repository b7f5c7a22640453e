"""Configuration: precedence (defaults < model defaults < TOML < flags) and validation."""

import pytest

from mpidl import config
from mpidl.errors import ConfigError


@pytest.fixture(autouse=True, scope="module")
def runtime_options():
    """The runtime's parts declare the parallelism settings (as the command line does)."""
    from mpidl.cli.train import register_options

    register_options()


@pytest.fixture(autouse=True)
def fake_model_defaults(monkeypatch):
    monkeypatch.setattr(config, "model_defaults",
                        lambda model: {"lr": 0.2, "epochs": 7} if model == "m" else {})


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_precedence(tmp_path):
    path = write(tmp_path, 'model = "m"\nepochs = 3\nbatch-size = 16\n')
    cfg = config.resolve({"batch_size": 8}, path)
    assert cfg.model == "m" and cfg.lr == 0.2      # model default over built-in
    assert cfg.epochs == 3                          # file over model default
    assert cfg.batch_size == 8                      # flag over file
    assert cfg.optimizer == "sgd"                   # built-in default
    assert cfg.config.endswith("c.toml")


def test_flag_model_picks_model_defaults(tmp_path):
    cfg = config.resolve({"model": "m"}, write(tmp_path, 'model = "other"\n'))
    assert cfg.lr == 0.2


def test_unknown_key_names_key_and_lists_valid_ones(tmp_path):
    path = write(tmp_path, "lrr = 0.1\n")
    with pytest.raises(ConfigError) as e:
        config.resolve({}, path)
    msg = str(e.value)
    assert "unknown key 'lrr'" in msg and path in msg and "batch_size" in msg and "\n" not in msg


@pytest.mark.parametrize("text, match", [
    ('lr = "fast"\n', "lr must be float"),
    ("epochs = 2.5\n", "epochs must be int"),
    ("resume = 1\n", "resume must be bool"),
    ("lr = \n", "not valid TOML"),
])
def test_bad_values_in_file(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        config.resolve({}, write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.resolve({}, str(tmp_path / "nope.toml"))


@pytest.mark.parametrize("flags, match", [
    ({"lr": -0.1}, "--lr must be positive, got -0.1"),
    ({"lr": 0.0}, "--lr must be positive"),
    ({"epochs": 0}, "--epochs must be at least 1"),
    ({"batch_size": 0}, "--batch-size must be at least 1"),
    ({"momentum": 1.5}, r"--momentum must be in \[0, 1\)"),
    ({"optimizer": "lion"}, "--optimizer must be one of sgd, adam, adamw"),
    ({"device": "tpu"}, "--device must be one of cpu, gpu"),
    ({"ratio": 2.0}, "--ratio must be in"),
    ({"nesterov": True, "optimizer": "adam"}, "--nesterov needs"),
])
def test_validation(flags, match):
    with pytest.raises(ConfigError, match=match):
        config.resolve(flags)


def test_float_accepts_int(tmp_path):
    assert config.resolve({}, write(tmp_path, "lr = 1\n")).lr == 1.0


@pytest.mark.parametrize("text, want", [
    ("", "auto"), ('overlap = "on"\n', "on"), ('overlap = "off"\n', "off"),
    ("overlap = false\n", "off"), ("overlap = true\n", "on"),  # the older boolean key
])
def test_overlap_setting_from_file(tmp_path, text, want):
    cfg = config.resolve({}, write(tmp_path, text))
    assert cfg.overlap == want
    # only a setting that differs from the default reaches the strategy
    assert config.strategy_kwargs(cfg).get("overlap", "auto") == want


def test_overlap_setting_rejects_other_words():
    with pytest.raises(ConfigError, match="--overlap must be one of auto, on, off"):
        config.resolve({"overlap": "sometimes"})


@pytest.mark.parametrize("argv, want", [
    ([], None), (["--overlap", "on"], "on"), (["--overlap", "off"], "off"),
    (["--no-overlap"], "off"),
])
def test_overlap_flag_reaches_the_strategy(argv, want):
    import argparse

    from mpidl.cli import train
    from mpidl.runtime import build

    parser = argparse.ArgumentParser()
    train.register(parser.add_subparsers())
    args = vars(parser.parse_args(["train"] + argv))
    flags = {k: v for k, v in args.items() if k in config.OPTIONS_BY_NAME}
    kwargs = config.strategy_kwargs(config.resolve(flags))
    assert kwargs.get("overlap") == want
    runtime = build("allreduce", None, **kwargs)
    assert runtime.syncs[0][1].overlap_mode == (want or "auto")

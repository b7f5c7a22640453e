"""Pipeline parallelism (``--pipeline-stages P``): schedules as data, the cut, refusals,
and real ranks against one process.

The multi-rank cases launch ``tests/ranks/pp_check.py``: for every schedule (gpipe,
1f1b, interleaved:2, zb), P = 2, 3, 4 (and 8, oversubscribed), M in {1, P - 1, P, 4P},
the mlp (eight hidden layers), resnet-tiny and gpt-tiny, SGD with momentum and Adam, 20
steps in float64: the parameters are bitwise those of one process accumulating over the
same micro-batches, and each stage's peak of held micro-batches and activation bytes is
the schedule's formula. ``async`` (PipeDream-2BW, M >= P - 1) is held to one process
applying each step's gradient a step later, bitwise too, with two weight versions per
stage. Every launch has a timeout, so a (P, M) pair that hangs fails.
The 3-D layouts (data x pipeline x tensor parallelism on 8 ranks, with ZeRO 1 too) are
held to 1e-12. ``mpidl train`` itself is compared with one process bit for bit, and a
pipelined run's checkpoint resumes on one process and the other way round.
"""

import itertools
import json
import os
import shutil

import numpy as np
import pytest

from mpirun import assert_bitwise_equal, model_arrays, needs_fashion, run_cli_cases, \
    run_command, run_ranks, train_cmd
from mpidl.config import register, resolve
from mpidl.engine.models import build_model
from mpidl.errors import ConfigError
from mpidl.runtime import build, cli_options
from mpidl.runtime.pipeline import Pipeline, check_degree, partition
from mpidl.runtime.pipeline_schedule import build as plan, bubble_formula, parse

HERE = os.path.dirname(os.path.abspath(__file__))
PP_CHECK = os.path.join(HERE, "ranks", "pp_check.py")
KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb", 1)]


# -- schedules as data (one process) -----------------------------------------------------

@pytest.mark.parametrize("kind, v", KINDS)
def test_every_plan_runs_each_pass_once_in_micro_batch_order(kind, v):
    """Each rank runs every forward and backward of its chunks once (zb: every weight
    pass too), backward passes of a chunk in micro-batch order (the order one process
    accumulates in), and the lists run to the end: no (P, M) deadlocks."""
    for P in range(1, 9):
        for M in sorted({1, 2, P - 1, P, P + 1, 2 * P + 1, 4 * P} - {0}):
            p = plan(kind, P, M, v)
            for r in range(P):
                acts = p.actions[r]
                for c in range(p.v):
                    for op in ("FBW" if p.split_backward else "FB"):
                        mbs = [mb for o, mb, ch in acts if o == op and ch == c]
                        if op == "F":
                            assert sorted(mbs) == list(range(M)), (kind, P, M, r, c)
                        else:
                            assert mbs == list(range(M)), (kind, P, M, r, c, op, mbs)
            p.simulate(1.0, 2.0, 0.5, latency=0.1)  # raises if the lists deadlock


@pytest.mark.parametrize("kind, v", KINDS)
def test_peak_micro_batches_held_is_the_formula(kind, v):
    for P in (1, 2, 3, 4, 8):
        for M in (1, P - 1 or 1, P, 4 * P, 33):
            p = plan(kind, P, M, v)
            for r in range(P):
                assert p.peak_in_flight(r) == p.in_flight_formula(r), (kind, P, M, r)
            if kind in ("1f1b", "zb"):
                assert [p.in_flight_formula(r) for r in range(P)] == \
                    [min(P - r, M) for r in range(P)]
            elif kind == "gpipe":
                assert all(p.in_flight_formula(r) == M for r in range(P))


@pytest.mark.parametrize("P, M", [(2, 4), (4, 4), (4, 16), (8, 32), (3, 1), (5, 7)])
def test_simulated_bubble_is_the_formula(P, M):
    """With backward = 2 forwards and free messages, GPipe's and 1F1B's idle fraction is
    (P - 1)/(M + P - 1); interleaved's (P - 1)/(vM + P - 1) when P divides M; the
    zero-bubble schedule idles less than 1F1B; message latency only adds."""
    for kind in ("gpipe", "1f1b"):
        assert plan(kind, P, M).simulate(1, 2).bubble == pytest.approx(
            bubble_formula(kind, P, M), abs=1e-12)
    if M % P == 0 and P > 1:
        assert plan("interleaved", P, M, 2).simulate(0.5, 1).bubble == pytest.approx(
            bubble_formula("interleaved", P, M, 2), abs=1e-12)
    if P > 1:
        zb = plan("zb", P, M).simulate(1, 1, 1).bubble
        assert zb < plan("1f1b", P, M).simulate(1, 2).bubble
        slow = plan("1f1b", P, M).simulate(1, 2, latency=0.3)
        assert slow.step_time > plan("1f1b", P, M).simulate(1, 2).step_time


def test_async_plan_runs_every_micro_batch_once_across_steps():
    """async (PipeDream-2BW): over a run of steps (the first, steady ones, the drain),
    every stage runs each micro-batch's forward once and its backward once, backwards in
    micro-batch order, a stage carrying P - 1 - s of them into the next step; no list
    deadlocks; P - s micro-batches held, two weight versions (one on the last stage);
    the steady step idles (P - 1) / (3M + P - 1) (backward = 2 forwards), far below
    1F1B's flush."""
    for P in range(1, 9):
        for M in sorted({max(P - 1, 1), P, P + 1, 4 * P}):
            p = plan("async", P, M)
            steps = 3
            for r in range(P):
                lists = [p.opening[r]] + [p.actions[r]] * (steps - 1) + [p.closing[r]]
                fwd, bwd = [], []
                for t, acts in enumerate(lists):
                    fwd += [t * M + mb for op, mb, _ in acts if op == "F"]
                    bwd += [t * M + mb for op, mb, _ in acts if op == "B"]
                    assert all(mb >= -p.carried(r) for _, mb, _ in acts)
                assert fwd == bwd == list(range(steps * M)), (P, M, r)
                assert p.carried(r) == P - 1 - r <= M
                assert p.peak_in_flight(r) == p.in_flight_formula(r) == P - r
                assert p.weight_versions(r) == (2 if r < P - 1 else 1)
            for acts in (p.opening, p.actions, p.closing):
                p.actions, saved = acts, p.actions
                p.simulate(1.0, 2.0, latency=0.1)  # raises if the lists deadlock
                p.actions = saved
            steady = p.simulate(1.0, 2.0).bubble
            assert steady == pytest.approx(bubble_formula("async", P, M), abs=1e-12)
            if P > 1:
                assert steady < plan("1f1b", P, M).simulate(1.0, 2.0).bubble
    with pytest.raises(ConfigError, match=r"--schedule async with --pipeline-stages 4 needs "
                                          r"--micro-batches M >= 3 \(P - 1\), got 2"):
        plan("async", 4, 2)


def test_schedule_names():
    assert parse("interleaved") == ("interleaved", 2)
    assert parse("interleaved:3") == ("interleaved", 3)
    assert parse("1F1B") == ("1f1b", 1)
    assert parse("async") == ("async", 1)
    for bad, why in [("pipedream", "pipeline schedules are gpipe"),
                     ("interleaved:1", "v >= 2"), ("interleaved:x", "whole number"),
                     ("zb:2", "only interleaved takes"), ("async:2", "only interleaved")]:
        with pytest.raises(ConfigError, match=why):
            parse(bad)


def test_partition_is_balanced_contiguous_and_deterministic():
    assert partition([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert partition([1] * 7, 3) == [0, 2, 4, 7]  # pieces of 2, 2, 3
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    bounds = partition(costs, 4)
    assert bounds[0] == 0 and bounds[-1] == len(costs)
    assert all(lo < hi for lo, hi in zip(bounds, bounds[1:]))
    def largest(b):
        return max(sum(costs[lo:hi]) for lo, hi in zip(b, b[1:]))

    best = min(largest([0, *cuts, 8]) for cuts in itertools.combinations(range(1, 8), 3))
    assert largest(bounds) == best == 9.0
    assert partition(costs, 4) == bounds


# -- settings and refusals (point 6) ----------------------------------------------------

def test_schedule_flag_takes_the_lr_and_the_pipeline_schedule():
    register(cli_options())  # (the command line registers the runtime's settings)
    cfg = resolve({"model": "mlp", "schedule": "cosine,1f1b"})
    assert (cfg.schedule, cfg.pipeline_schedule) == ("cosine", "1f1b")
    cfg = resolve({"model": "gpt-tiny", "schedule": "interleaved:2"})
    assert cfg.schedule == "cosine" and cfg.pipeline_schedule == "interleaved:2"
    cfg = resolve({"model": "mlp", "micro_batches": 4})
    assert cfg.accumulate == 4
    with pytest.raises(ConfigError, match="give at most one value of each kind"):
        resolve({"schedule": "gpipe,1f1b"})
    with pytest.raises(ConfigError, match="are the same setting"):
        resolve({"micro_batches": 4, "accumulate": 2})


def test_bad_pipelines_are_one_line_each():
    model = build_model("mlp", input_shape=(1, 4, 4), num_classes=3, hidden=(8,))
    assert len(model.layers) == 4  # Flatten, Linear, ReLU, Linear
    with pytest.raises(ConfigError, match=r"--pipeline-stages 5 needs at least 5 top-level "
                                          r"layers to place, but the model has 4"):
        Pipeline(5).check(model)
    with pytest.raises(ConfigError, match=r"interleaved:2 \(6 chunks\) needs at least 6 "
                                          r"top-level layers"):
        Pipeline(3, "interleaved:2").check(model)
    with pytest.raises(ConfigError, match="--micro-batches must be at least 1"):
        Pipeline(2, "1f1b", 0)
    with pytest.raises(ConfigError, match=r"--pipeline-stages 3 does not divide the 4 rank"):
        check_degree(3, 1, 4)
    with pytest.raises(ConfigError, match=r"--pipeline-stages 2 x --tensor-parallel 2 = 4 "
                                          r"does not divide the 6 rank"):
        check_degree(2, 2, 6)
    tied = build_model("gpt-tiny", input_shape=(8,), num_classes=12, layers=1, heads=2,
                       width=8, context=8, tie_weights=True)
    Pipeline(2).check(tied)  # a TiedHead's weight: the stages share it
    under_zero3 = Pipeline(2)
    under_zero3.zero_stage = 3  # (as the ZeRO preset sets it: test_bad_input_from_the_...)
    for pipeline, what in [(Pipeline(2, "async", 2), "--schedule async"),
                           (Pipeline(2, emulate_compute=True), "--emulate-compute"),
                           (under_zero3, "--zero 3")]:
        with pytest.raises(ConfigError, match=r"^--pipeline-stages 2 with tied weights "
                                              rf"\(--tie-weights\) and {what} is not built"):
            pipeline.check(tied)
    shared = build_model("mlp", input_shape=(1, 4, 4), num_classes=8, hidden=(8,))
    shared.layers[3].weight = shared.layers[1].weight  # (one Parameter, no TiedHead)
    shared.layers[3]._params["weight"] = shared.layers[1].weight
    with pytest.raises(ConfigError, match="layers 1 and 3 share a parameter, which stages "
                                          "can share only as a TiedHead's weight"):
        Pipeline(2).check(shared)
    with pytest.raises(ConfigError, match="--stage-costs: expected 4 costs"):
        Pipeline(2, stage_costs="1,2").check(model)
    with pytest.raises(ConfigError, match="--pipeline-stages 2 cannot be used with "
                                          "--strategy ps"):
        build("ps", None, pipeline_stages=2)
    with pytest.raises(ConfigError, match="--recompute needs --pipeline-stages P > 1"):
        build("local", None, recompute=True)
    with pytest.raises(ConfigError, match="--schedule async needs --pipeline-stages P > 1"):
        build("allreduce", None, pipeline_schedule="async")
    with pytest.raises(ConfigError, match=r"--schedule async with --pipeline-stages 3 needs "
                                          r"--micro-batches M >= 2"):
        Pipeline(3, "async", 1)
    for flags, what in [(dict(hybrid="conv-dp-fc-mp"), "--hybrid conv-dp-fc-mp"),
                        (dict(sync="local-sgd", period=4, pipeline_schedule="async",
                              micro_batches=2), "--schedule async and --sync local-sgd"),
                        (dict(zero=3, pipeline_schedule="async", micro_batches=2),
                         "--zero 3 and --schedule async"),
                        (dict(zero=3, emulate_compute=True), "--zero 3 and --emulate-compute"),
                        (dict(zero=3, zero_reuse="on"), "--zero 3 and --zero-reuse on")]:
        with pytest.raises(ConfigError, match=f"--pipeline-stages 2 with {what} is not "
                                              "built yet"):
            build("allreduce", None, pipeline_stages=2, **flags)



def test_bad_input_from_the_command_line_is_one_line(tmp_path):
    """Refused in the set-up phase, each case one line and exit 2 (the cases of a rank
    count in one launch: ``mpirun.run_cli_cases``)."""
    text = tmp_path / "tiny.txt"
    text.write_text("the cat sat on the mat\n" * 50, encoding="utf-8")
    tied = ["--model", "gpt-tiny", "--dataset", "text", "--data-dir", text, "--layers", "1",
            "--context", "16", "--tie-weights"]
    cases = {1: [(["--micro-batches", "0"], "--micro-batches must be at least 1"),
                 (["--tied-exchange", "step"], "--tied-exchange needs --pipeline-stages P > 1"),
                 (["--pipeline-stages", "2"], "--pipeline-stages 2 does not divide the 1 "
                                              "rank")],
             2: [(["--pipeline-stages", "2", "--schedule", "interleaved:4"],
                  "needs at least 8 top-level layers to place, but the model has 6"),
                 (["--pipeline-stages", "2", "--zero", "3", "--zero-reuse", "on"],
                  "--pipeline-stages 2 with --zero 3 and --zero-reuse on is not built yet"),
                 (["--pipeline-stages", "2", "--tied-exchange", "step"],
                  "--tied-exchange step: the model has no tied weights (--tie-weights)"),
                 ([*tied, "--pipeline-stages", "2", "--zero", "3", "--sparse-grads", "dense"],
                  "--pipeline-stages 2 with tied weights (--tie-weights) and --zero 3 is not "
                  "built yet")]}
    base = ["train", "--no-progress", "--out-dir", tmp_path / "bad", "--model", "mlp",
            "--dataset", "synthetic"]
    for n, group in cases.items():
        launches = run_cli_cases([base + args for args, _ in group], n=n)
        for launch, (args, message) in zip(launches, group):
            assert launch.returncode == 2, (args, launch.output)
            lines = [ln for ln in launch.output.splitlines() if message in ln]
            assert lines, (args, launch.output)
            assert "Traceback" not in launch.output, launch.output


# -- real ranks: every layout against one process (points 1, 2, 4) ------------------------

def pp_check(ranks, layouts, models, kinds, micro, optimizers, steps=20, flags="",
             timeout=600):
    args = [PP_CHECK, layouts, models, kinds, micro, optimizers, steps]
    if flags:
        args.append(flags)
    launch = run_ranks(ranks, args, timeout=timeout)
    assert not launch.timed_out, f"a pipeline hung (no result in {timeout} s):\n{launch.output}"
    launch.check()
    return launch.output


ALL_KINDS = "gpipe,1f1b,interleaved:2,zb,async"  # (async: M >= P - 1 only)


def _bitwise_lines(out):
    return [ln for ln in out.splitlines() if ln.startswith("pp_check ") and "bitwise" in ln]


def test_every_schedule_equals_one_process_bitwise():
    """Point 1 (the CI slice): every schedule (and async) x three models, 6 steps,
    bitwise one process and the memory formulas -- P = 2 over M in {1, P, 4P} with SGD +
    momentum. Adam is in CI through the 3-D layouts, P = 4 and 8 through
    test_eight_stages_oversubscribed and the 3-D layouts; the full grids at P = 2, 3 and 4
    (Adam too) are the slow test below."""
    out = pp_check(2, "2x1", "mlp,resnet,gpt", ALL_KINDS, "1,P,4P", "sgd", 6)
    assert len(_bitwise_lines(out)) == 3 * 1 * 5 * 3, out


def test_tied_weights_across_stages_equal_one_process():
    """gpt-tiny with --tie-weights (the token embedding on the first stage, the head
    reading its weight on the last): bitwise one process at P = 2 over every flushing
    schedule and M in {1, P, 4P} with Adam (the owner adds each micro-batch's head
    gradient before the embedding's, one process's order). Slow: P = 3 and 4 with
    recompute and dropout; with data and tensor parallelism and ZeRO 1 (4 and 8 ranks),
    within 1e-12 as every such layout."""
    out = pp_check(2, "2x1", "gpt", "gpipe,1f1b,interleaved:2,zb", "1,P,4P", "adam", 10,
                   "tied")
    assert len(_bitwise_lines(out)) == 4 * 3, out
    # --tied-exchange step (Megatron's one sum per step): within 1e-12, not bitwise
    out = pp_check(2, "2x1", "gpt", "1f1b,zb", "1,4P", "adam", 6, "tiedstep")
    assert "4 layouts equal one process" in out and not _bitwise_lines(out), out


def test_sync_bn_in_pipelines_equals_one_process():
    """--sync-bn with data parallelism 2 under a pipeline: each stage's BatchNorms
    normalize over both replicas' micro-batch, so resnet-tiny matches one process whose
    micro-batch is the replicas' together, within 1e-12 (without --sync-bn the same
    comparison is off by about 5), every schedule; slow: with --recompute (the forward run
    again synchronizes again, statistics counted once) and ZeRO 1."""
    out = pp_check(4, "2x1", "resnet", "gpipe,1f1b,interleaved:2,zb,async", "1,4", "sgd", 6,
                   "syncbn")
    assert "10 layouts equal one process" in out, out


@pytest.mark.slow
def test_sync_bn_in_pipelines_with_recompute_and_zero():
    out = pp_check(4, "2x1", "resnet", "1f1b,zb", "4", "adam", 6, "syncbn,recompute,zero1")
    assert "2 layouts equal one process" in out, out


def test_mixed_precision_in_pipelines_equals_one_process():
    """--precision bf16 and fp16 under a pipeline: each chunk rounds its input and its
    incoming gradient as the whole model does (values from a stage boundary are on the
    grid already), so P = 2 is bitwise one process with the same precision over every
    schedule (the gpt-tiny too: its embeddings' rows, attention and position embedding);
    fp16 from a loss scale of 2**18 skips the same steps with the same scale,
    and needs the stages to agree on an overflow (in this run a step overflows on one
    stage only: without the agreement it is not bitwise, tried by hand)."""
    out = pp_check(2, "2x1", "mlp,gpt", ALL_KINDS, "1,4", "sgd", 6, "bf16")
    assert len(_bitwise_lines(out)) == 20, out
    out = pp_check(2, "2x1", "mlp,resnet", "1f1b,zb", "1,4", "adam", 10, "fp16")
    assert len(_bitwise_lines(out)) == 8, out


@pytest.mark.slow
def test_mixed_precision_over_pipelines_equals_plain_data_parallelism(tmp_path):
    """bf16 and fp16 on 2 replicas of a 2-stage pipeline save bitwise the model of 2 plain
    data-parallel ranks with --accumulate 2, fp16 with the same skipped steps and scale."""
    for precision in (["bf16"], ["fp16", "--loss-scale", "262144"]):
        common = ["--model", "mlp", "--dataset", "synthetic", "--epochs", "1",
                  "--limit-train", "512", "--limit-test", "128", "--batch-size", "16",
                  "--precision", *precision]
        dp, pp = tmp_path / f"dp-{precision[0]}", tmp_path / f"pp-{precision[0]}"
        run_command(train_cmd(2, dp, *common, "--accumulate", "2", dtype="float32"),
                    timeout=300).check()
        run_command(train_cmd(4, pp, *common, "--pipeline-stages", "2", "--micro-batches",
                              "2", dtype="float32"), timeout=300).check()
        assert_bitwise_equal(model_arrays(dp / "model.npz"), model_arrays(pp / "model.npz"))
        a, b = (json.loads(open(d / "metrics.jsonl").readlines()[-1]) for d in (dp, pp))
        assert a.get("skipped_steps_total") == b.get("skipped_steps_total"), (a, b)
        assert a.get("loss_scale") == b.get("loss_scale"), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [3, 4])
def test_tied_weights_across_stages_full_grid(stages):
    out = pp_check(stages, f"{stages}x1", "gpt", "gpipe,1f1b,interleaved:2,zb", "1,P-1,4P",
                   "sgd,adamw", 10, "tied,recompute,dropout")
    assert len(_bitwise_lines(out)) == 2 * 4 * 3, out


@pytest.mark.slow
def test_tied_weights_in_three_d_layouts():
    out = pp_check(4, "2x1,2x2", "gpt", "1f1b,interleaved:2", "4", "adamw", 6, "tied,zero1")
    assert "4 layouts equal one process" in out, out
    out = pp_check(8, "2x2,4x2,2x4,4x1", "gpt", "1f1b,interleaved:2", "4", "adamw", 10,
                   "tied,zero1", timeout=900)
    assert "8 layouts equal one process" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_schedule_equals_one_process_bitwise_full_grid(stages):
    out = pp_check(stages, f"{stages}x1", "mlp,resnet,gpt", ALL_KINDS, "1,P-1,P,4P",
                   "sgd,adam")
    ms = 3 if stages == 2 else 4  # at P = 2, P - 1 is M = 1; async needs M >= P - 1
    assert len(_bitwise_lines(out)) == 3 * 2 * (4 * ms + 3), out


def test_recompute_and_dropout_equal_one_process_bitwise():
    """--recompute re-runs each stage's forward from its kept input with the buffers it
    saw (the same dropout masks, BatchNorm statistics counted once): still bitwise, and
    only the inputs are held."""
    out = pp_check(2, "2x1", "mlp,gpt", ALL_KINDS, "1,4P", "sgd", 6, "recompute,dropout")
    assert out.count("bitwise") == 2 * 5 * 2, out
    out = pp_check(3, "3x1", "resnet", "1f1b,zb", "1,P", "adam", 6, "recompute")
    assert out.count("bitwise") == 2 * 2, out


def test_eight_stages_oversubscribed():
    """P = 8 on 8 ranks (4 per core): the deepened mlp over every schedule; resnet-tiny and
    gpt-tiny (9 top-level layers) take 8 stages, and interleaved:2's 16 chunks are
    refused with one line."""
    out = pp_check(8, "8x1", "mlp,gpt", ALL_KINDS, "1,P", "sgd", 5, timeout=900)
    assert out.count("bitwise") == 4 * 2 + 3 * 2 + 2, out
    assert "1 refused" in out, out


@pytest.mark.slow
def test_eight_stages_full_grid():
    out = pp_check(8, "8x1", "mlp,resnet,gpt", ALL_KINDS, "1,P-1,P,4P", "sgd,adam",
                   timeout=3000)
    assert "layouts equal one process" in out


LAYOUTS_3D = "2x2,4x1,2x1,4x2,1x4,2x4,1x2"  # P x T; data parallelism: 8 / (P T)


@pytest.mark.parametrize("models, zero2_meshes, async_meshes, steps", [
    ("gpt", None, "2x2", 6),
    pytest.param("gpt,mlp", "2x2,2x1,1x2", "2x2,4x1,2x1", 20, marks=pytest.mark.slow,
                 id="full-grid"),
])
def test_three_d_layouts_equal_one_process(models, zero2_meshes, async_meshes, steps):
    """Point 4: every DP x PP x TP factorisation of 8 with P, T <= 4 (2x2x2, 2x4x1,
    4x2x1, 1x4x2, 2x1x4, 1x2x4, 4x1x2) equals one process at the global batch within
    1e-12 (the gpt-tiny: every kind of layer split); asynchronous (PipeDream-2BW's rule in
    the one process too) with --zero 1 and Adam. The slow grid adds the mlp, more meshes
    and meshes with --zero 2; --zero 1 with zb on all seven: the slow test below."""
    out = pp_check(8, LAYOUTS_3D, models, "1f1b", "4", "sgd", steps, timeout=900)
    assert f"{7 * len(models.split(','))} layouts equal one process" in out, out
    if zero2_meshes:  # (CI: ZeRO 1 on the 2 x 2 x 2 mesh in the checkpoint test below)
        out = pp_check(8, zero2_meshes, "gpt", "1f1b", "4", "adam", steps, "zero2",
                       timeout=900)
        assert f"{len(zero2_meshes.split(','))} layouts equal one process" in out, out
    out = pp_check(8, async_meshes, "gpt", "async", "4", "adam", steps, "zero1",
                   timeout=900)
    assert f"{len(async_meshes.split(','))} layouts equal one process" in out, out


@pytest.mark.slow
def test_three_d_layouts_with_zero1_full_grid():
    out = pp_check(8, LAYOUTS_3D, "gpt", "zb", "4", "sgd", 20, "zero1", timeout=900)
    assert "7 layouts equal one process" in out, out


# -- mpidl train -----------------------------------------------------------------------------


RUN = ["--model", "mlp", "--batch-size", "16", "--limit-train", "1280", "--limit-test",
       "300", "--micro-batches", "4", "--epochs", "2"]


def test_train_command_equals_one_process_and_resumes_across_layouts(tmp_path):
    """``mpiexec -n 2 mpidl train --pipeline-stages 2`` (float64, 40 steps) saves bitwise
    the model of one process with --accumulate 4 and reports the same test loss; a
    checkpoint of the pipelined run resumes on one process and one of a one-process run
    resumes as a pipeline, both ending bitwise where the uninterrupted run ends."""
    needs_fashion()
    one = ["--strategy", "allreduce"]  # one process, so the checkpoints' settings agree
    run_command(train_cmd(1, tmp_path / "one", *RUN, *one), timeout=300).check()
    launch = run_command(train_cmd(2, tmp_path / "pp", *RUN, "--pipeline-stages", "2",
                                   "--schedule", "zb"), timeout=300).check()
    assert "pipeline 2 stages, zb, x tensor parallel 1 x data parallel 1" in launch.output
    assert "pipeline stages balanced by measured cost" in launch.output, launch.output
    assert_bitwise_equal(model_arrays(tmp_path / "one" / "model.npz"),
                         model_arrays(tmp_path / "pp" / "model.npz"))
    a, b = (json.loads(open(tmp_path / d / "metrics.jsonl").readlines()[-1])
            for d in ("one", "pp"))
    assert a["test_loss"] == b["test_loss"] and a["test_acc"] == b["test_acc"]
    assert b["pipeline_stages"] == 2 and b["pipeline_in_flight"] == 2

    for saved, resumed in ((["--pipeline-stages", "2"], one), (one, ["--pipeline-stages",
                                                                      "2"])):
        n_saved = 2 if "--pipeline-stages" in saved else 1
        out = tmp_path / f"saved-on-{n_saved}"
        crashed = run_command(train_cmd(n_saved, out, *RUN, *saved, "--checkpoint-every",
                                        "10"), env={"MPIDL_FAIL_AT": "0:25"}, timeout=300)
        assert crashed.returncode != 0, crashed.output  # killed after step 25
        n_resumed = 2 if "--pipeline-stages" in resumed else 1
        launch = run_command(train_cmd(n_resumed, out, *RUN, *resumed, "--resume",
                                       "--checkpoint-every", "10"), timeout=300).check()
        assert "resumed from" in launch.output and "step 20" in launch.output, launch.output
        assert_bitwise_equal(model_arrays(tmp_path / "one" / "model.npz"),
                             model_arrays(out / "model.npz"))
    shutil.rmtree(tmp_path / "pp")


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16",
                                                              marks=pytest.mark.slow)])
def test_mixed_precision_pipeline_resumes_bitwise_from_a_shard_per_stage(tmp_path,
                                                                          precision):
    """``mpidl train --pipeline-stages 2 --precision bf16`` (Adam, 2 micro-batches) killed
    after its step-4 checkpoint: each stage wrote its own shard (its parameters, Adam's
    moments and float32 masters), the root an index holding none of them; resumed, the
    run ends bitwise the uninterrupted one (it failed before: the root's checkpoint held
    only the first stage's masters)."""
    import sys

    from mpirun import mpiexec_cmd

    def train(args, env=None):
        cmd = [*mpiexec_cmd(), "-n", "2", sys.executable, "-m", "mpidl.cli.main", "train",
               "--no-progress",
               "--dataset", "synthetic", "--limit-train", "200", "--limit-test", "32",
               "--epochs", "2", "--batch-size", "16", "--model", "mlp", "--optimizer",
               "adam", "--lr", "0.001", "--precision", precision, "--pipeline-stages",
               "2", "--micro-batches", "2", *[str(a) for a in args]]
        if precision == "fp16":
            cmd += ["--loss-scale", str(2.0 ** 17), "--loss-scale-window", "3"]
        return run_command(cmd, env=env, timeout=300)

    train(["--out-dir", tmp_path / "whole"]).check()
    out, ck = tmp_path / "crashed", tmp_path / "crashed" / "checkpoints"
    crashed = train(["--out-dir", out, "--checkpoint-every", "2"],
                    env={"MPIDL_FAIL_AT": "0:5"})
    assert crashed.returncode != 0, crashed.output
    shards = [ck / f"ckpt-000000004-shard-{i}-of-2.npz" for i in range(2)]
    assert all(os.path.getsize(f) > 1_000_000 for f in shards), os.listdir(ck)
    assert os.path.getsize(ck / "ckpt-000000004.npz") < 50_000
    launch = train(["--out-dir", out, "--checkpoint-every", "2", "--resume"]).check()
    assert "resumed from" in launch.output and "step 4" in launch.output, launch.output
    assert_bitwise_equal(model_arrays(tmp_path / "whole" / "model.npz"),
                         model_arrays(out / "model.npz"))


def test_tied_gpt_equals_one_process_and_resumes_from_the_command_line(tmp_path):
    """gpt-tiny with --tie-weights on 2 stages (the token embedding on the first, the head
    reading its weight on the last; 1f1b, M = 4, float64, 32 steps): the saved model is
    bitwise one process's with --accumulate 4 and the test loss the same (evaluation
    takes the owner's weight too); killed after step 25, it resumes from its step-20
    checkpoint on one process and ends bitwise there."""
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    rng = np.random.default_rng(0)
    text = tmp_path / "tiny.txt"
    text.write_text(" ".join(words[i] for i in rng.integers(0, len(words), 1500)) + "\n",
                    encoding="utf-8")
    run = ["--model", "gpt-tiny", "--dataset", "text", "--data-dir", str(text), "--layers",
           "2", "--heads", "2", "--width", "16", "--context", "16", "--tie-weights",
           "--batch-size", "4", "--micro-batches", "4", "--limit-train", "256",
           "--limit-test", "16", "--epochs", "2"]
    one = ["--strategy", "allreduce"]
    pp = ["--pipeline-stages", "2"]
    run_command(train_cmd(1, tmp_path / "one", *run, *one), timeout=300).check()
    run_command(train_cmd(2, tmp_path / "pp", *run, *pp), timeout=300).check()
    assert_bitwise_equal(model_arrays(tmp_path / "one" / "model.npz"),
                         model_arrays(tmp_path / "pp" / "model.npz"))
    a, b = (json.loads(open(tmp_path / d / "metrics.jsonl").readlines()[-1])
            for d in ("one", "pp"))
    assert a["step"] == b["step"] == 32 and a["test_loss"] == b["test_loss"], (a, b)
    out = tmp_path / "crashed"
    crashed = run_command(train_cmd(2, out, *run, *pp, "--checkpoint-every", "10"),
                          env={"MPIDL_FAIL_AT": "1:25"}, timeout=300)
    assert crashed.returncode != 0, crashed.output
    launch = run_command(train_cmd(1, out, *run, *one, "--resume", "--checkpoint-every",
                                   "10"), timeout=300).check()
    assert "resumed from" in launch.output and "step 20" in launch.output, launch.output
    assert_bitwise_equal(model_arrays(tmp_path / "one" / "model.npz"),
                         model_arrays(out / "model.npz"))


SMALL_MLP = """
import math
from mpidl.engine import Flatten, Linear, ReLU, Sequential


def build(input_shape, num_classes, rng, dtype):
    return Sequential(Flatten(), Linear(math.prod(input_shape), 48, rng=rng, dtype=dtype),
                      ReLU(), Linear(48, 32, rng=rng, dtype=dtype), ReLU(),
                      Linear(32, num_classes, rng=rng, dtype=dtype))
"""


def _over_pipelines_as_data_parallelism(tmp_path, args, refusal=None, dtype="float64"):
    """2 replicas of a 2-stage pipeline of a small MLP (4 ranks) against 2 plain
    data-parallel ranks with --accumulate 2, both with ``args``: the saved models bitwise
    equal. With ``refusal``: the pipelined run killed after step 11 resumes from its
    step-9 checkpoint and ends bitwise where it ended uninterrupted, and resuming that
    checkpoint without the pipeline is refused with one line containing ``refusal``."""
    (tmp_path / "small.py").write_text(SMALL_MLP)
    common = ["--model", f"{tmp_path / 'small.py'}:build", "--dataset", "synthetic",
              "--epochs", "2", "--limit-train", "512", "--limit-test", "128",
              "--batch-size", "16", *args]
    pp = ["--pipeline-stages", "2", "--micro-batches", "2"]
    run_command(train_cmd(2, tmp_path / "dp", *common, "--accumulate", "2", dtype=dtype),
                timeout=300).check()
    launch = run_command(train_cmd(4, tmp_path / "pp", *common, *pp, dtype=dtype),
                         timeout=300).check()
    assert "pipeline 2 stages" in launch.output, launch.output
    assert_bitwise_equal(model_arrays(tmp_path / "dp" / "model.npz"),
                         model_arrays(tmp_path / "pp" / "model.npz"))
    if refusal is None:
        return
    out = tmp_path / "crashed"
    crashed = run_command(train_cmd(4, out, *common, *pp, "--checkpoint-every", "3",
                                    dtype=dtype),
                          env={"MPIDL_FAIL_AT": "2:11"}, timeout=300)
    assert crashed.returncode != 0, crashed.output
    refused = run_command(train_cmd(2, out, *common, "--accumulate", "2", "--resume",
                                    dtype=dtype), timeout=300)
    assert refused.returncode == 2 and refusal in refused.output, refused.output
    launch = run_command(train_cmd(4, out, *common, *pp, "--resume", "--checkpoint-every",
                                   "3", dtype=dtype), timeout=300).check()
    assert "resumed from" in launch.output and "step 9" in launch.output, launch.output
    assert_bitwise_equal(model_arrays(tmp_path / "pp" / "model.npz"),
                         model_arrays(out / "model.npz"))


@pytest.mark.parametrize("sync", [
    pytest.param(["--sync", "local-sgd"], marks=pytest.mark.slow),
    ["--sync", "diloco", "--warmup-steps", "2"]], ids=["local-sgd", "diloco"])
def test_model_averaging_over_pipelines_equals_plain_data_parallelism(tmp_path, sync):
    """--sync local-sgd (slow) and diloco on 2 replicas of a 2-stage pipeline save bitwise
    the model of 2 plain data-parallel ranks (a replica's stages compute what its one rank
    computes; each stage averages its own parameters, a sum of two terms in either
    order); a DiLoCo run resumes mid-period with every rank's own parameters and outer
    state, bitwise; without the pipeline it refuses that checkpoint in one line."""
    refusal = ("written under 2 pipeline stages x 1 tensor-parallel on 4 ranks, this run "
               "has plain data parallelism; model averaging over pipelines or tensor "
               "parallelism resumes only under the layout it was written with")
    _over_pipelines_as_data_parallelism(tmp_path, [*sync, "--period", "4"],
                                        refusal if sync[1] == "diloco" else None)


@pytest.mark.parametrize("compression, resume", [
    (["dgc", "--ratio", "0.01"], False),
    pytest.param(["dgc", "--ratio", "0.01"], True, marks=pytest.mark.slow),
    pytest.param(["powersgd"], False, marks=pytest.mark.slow),
    pytest.param(["onebit"], False, marks=pytest.mark.slow),
    pytest.param(["fp16"], False, marks=pytest.mark.slow)],
    ids=["dgc", "dgc-resume", "powersgd", "onebit", "fp16"])
def test_compression_over_pipelines_equals_plain_data_parallelism(tmp_path, compression,
                                                                  resume):
    """--compression on 2 replicas of a 2-stage pipeline saves bitwise the model of 2 plain
    data-parallel ranks (per-tensor compressors see the same tensors; fp16's buckets sum
    two terms); a DGC run resumes with every rank's own residuals, bitwise (slow; in CI
    the diloco test above resumes through the same per-rank state); without the pipeline
    it refuses that checkpoint in one line."""
    refusal = ("gradient exchange state (error feedback residuals) was written under 2 "
               "pipeline stages")
    _over_pipelines_as_data_parallelism(tmp_path, ["--compression", *compression],
                                        refusal if resume else None, dtype="float32")


def test_async_pipeline_trains_and_resumes_exactly_from_the_command_line(tmp_path):
    """``--schedule async`` (PipeDream-2BW) from the command line: stage 0 holds two
    weight versions and two micro-batches; a run killed after step 25 resumes from its
    step-20 checkpoint (taken at a drain, with every rank's pending gradient) and ends
    bitwise where the uninterrupted run ends; resumed under another schedule, the pending
    step's update is dropped with one warning line."""
    needs_fashion()
    async_ = ["--pipeline-stages", "2", "--schedule", "async"]
    launch = run_command(train_cmd(2, tmp_path / "whole", *RUN, *async_), timeout=300).check()
    assert "no flush: weights one step stale (PipeDream-2BW)" in launch.output, launch.output
    last = json.loads(open(tmp_path / "whole" / "metrics.jsonl").readlines()[-1])
    assert last["pipeline_weight_versions"] == 2 and last["pipeline_in_flight"] == 2, last
    assert np.isfinite(last["test_loss"]) and last["test_acc"] > 0.5, last
    out = tmp_path / "crashed"
    crashed = run_command(train_cmd(2, out, *RUN, *async_, "--checkpoint-every", "10"),
                          env={"MPIDL_FAIL_AT": "0:25"}, timeout=300)
    assert crashed.returncode != 0, crashed.output
    other = tmp_path / "other"
    shutil.copytree(out, other)
    launch = run_command(train_cmd(2, out, *RUN, *async_, "--resume", "--checkpoint-every",
                                   "10"), timeout=300).check()
    assert "resumed from" in launch.output and "step 20" in launch.output, launch.output
    assert_bitwise_equal(model_arrays(tmp_path / "whole" / "model.npz"),
                         model_arrays(out / "model.npz"))
    launch = run_command(train_cmd(2, other, *RUN, "--pipeline-stages", "2", "--resume",
                                   "--epochs", "1"), timeout=300).check()
    assert "had one step's gradient still to apply; a schedule that applies each step's " \
        "gradient at once cannot take it over" in launch.output, launch.output


def test_three_d_zero1_checkpoint_resumes_as_plain_data_parallelism(tmp_path):
    """A 2 x 2 x 2 (DP x PP x TP) run with --zero 1, killed after step 25, resumes from
    its step-20 checkpoint as plain data parallelism on 2 ranks (ZeRO 1 again): the
    checkpoint holds the whole model and the whole optimizer state (a shard per rank, its
    chunks of its slices of its stage, joined when read), and the run ends within 1e-12
    of an uninterrupted 2-rank run."""
    needs_fashion()
    args = ["--model", "mlp", "--batch-size", "8", "--limit-train", "1280", "--limit-test",
            "200", "--epochs", "1", "--micro-batches", "2", "--zero", "1",
            "--checkpoint-every", "10"]
    run_command(train_cmd(2, tmp_path / "ref", *args), timeout=300).check()
    out = tmp_path / "run"
    crashed = run_command(train_cmd(8, out, *args, "--pipeline-stages", "2",
                                    "--tensor-parallel", "2"),
                          env={"MPIDL_FAIL_AT": "3:25"}, timeout=300)
    assert crashed.returncode != 0, crashed.output
    launch = run_command(train_cmd(2, out, *args, "--resume"), timeout=300).check()
    assert "resumed from" in launch.output and "step 20" in launch.output, launch.output
    a, b = model_arrays(tmp_path / "ref" / "model.npz"), model_arrays(out / "model.npz")
    assert sorted(a) == sorted(b)
    worst = max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(a[k]))) for k in a)
    assert worst <= 1e-12, worst


@pytest.mark.mpi_matrix_extra
def test_given_stage_costs_and_emulated_compute_from_the_command_line(tmp_path):
    """--stage-costs cuts where the costs say (the last layer alone weighs as much as the
    five before it), the cut is printed before training, and --emulate-compute runs the
    steps as sleeps of the measured times while the arrays travel: the epoch line says
    how idle the first stage was."""
    launch = run_command(train_cmd(2, tmp_path / "em", "--model", "mlp", "--dataset",
                                   "synthetic", "--pipeline-stages", "2", "--emulate-compute",
                                   "--stage-costs", "1,1,1,1,1,10", "--micro-batches", "4",
                                   "--batch-size", "8", "--limit-train", "256",
                                   "--limit-test", "64", "--epochs", "1", dtype="float32"),
                         timeout=120).check()
    out = launch.output
    assert "compute emulated by sleeps" in out, out
    assert "stage 0: layers 0-4, cost 5" in out and "stage 1: layer 5, cost 10" in out, out
    last = json.loads(open(tmp_path / "em" / "metrics.jsonl").readlines()[-1])
    assert last["pipeline_stages"] == 2 and last["pipeline_in_flight"] == 2
    assert 0.0 < last["pipeline_idle"] < 1.0

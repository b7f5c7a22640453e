"""``mpidl simulate``: the cost model of a training step (issue 18, points 3 and 5).

* exact structure: on real ranks (``tests/ranks/simulate_check.py``), the messages and
  bytes the model predicts per rank per step equal the communicator's counters, field by
  field and kind by kind, on every rank: the mlp and gpt-tiny (row gathers), every
  algorithm (``mpi``: calls only, as the counters count), small and large buckets, ring
  segments of 64 KiB (several per chunk), odd p, nodes of 2 ranks for the hierarchical
  all-reduce; ZeRO stages 1-3, model averaging (local SGD, DiLoCo) and mixed precision's
  2-byte buckets, compression, ``--sync-bn``; the parameter server in every mode, with
  one to three servers; tensor parallelism and pipeline parallelism (every schedule),
  group by group. A representative slice here; the grid for p = 2, 3, 4, 8 is ``slow``.
* the command: ``--json`` is one object whose ``bytes_per_step`` is what the epoch
  line's ``bytes_sent_per_step`` reports for the ring; ``--ranks 1-4096`` is fast;
  ``--calibrate`` writes a machine file the next run reads.
* bad input: one line, exit 2.
"""

import json
import os
import sys

import pytest

from mpirun import assert_one_line_error, run_cli_cases, run_command, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ranks", "simulate_check.py")
MPIDL = [sys.executable, "-m", "mpidl.cli.main"]
ENV = {"MPIDL_RING_SEGMENT": "65536", "MPIDL_TUNING": os.path.join(HERE, "no-tuning-file")}
ALL = "ring,tree,recursive_doubling,hierarchical,mpi,auto"


LAYOUTS = "zero1,zero2,zero3,local-sgd,diloco,bf16,fp16"
COMPRESSORS = "c-fp16,c-onebit,c-topk,c-randomk,c-qsgd,c-terngrad,c-powersgd,c-dgc,c-threshold"


def check_ranks(n, algs, buckets, models="mlp,gpt", per_node=None, timeout=240, layouts="dp"):
    env = dict(ENV)
    if per_node:
        env["MPIDL_RANKS_PER_NODE"] = str(per_node)
    launch = run_ranks(n, [SCRIPT, algs, buckets, models, layouts], timeout=timeout,
                       env=env).check()
    assert f"cases exact on {n} ranks" in launch.output, launch.output
    return launch


@pytest.mark.parametrize("n, algs, buckets, per_node", [
    (2, "ring,tree,recursive_doubling,hierarchical", "4", None),
    (3, "ring,tree,recursive_doubling,auto", "0.001", None),
    (4, "hierarchical,ring", "0.001,4", 2),   # two nodes of two ranks
])
def test_predicted_traffic_equals_counters(n, algs, buckets, per_node):
    check_ranks(n, algs, buckets, per_node=per_node)


# Each launch checks every layout it names under every algorithm and bucket size it names:
# an algorithm goes with a layout where the layout's own groups need it (ZeRO's
# reduce-scatters under each algorithm at p = 3, the worker groups' broadcasts, the
# hierarchical all-reduce on nodes); elsewhere one algorithm checks the layout, as each
# algorithm's all-reduce and gathers are checked at p = 2, 3 and 4 above (and its
# reduce-scatter in the first row here). Layouts whose groups leave no choice share a
# launch: the parameter server's and Hogwild's point-to-point traffic, per-tensor
# compressors (no buckets), a pipeline with a stage per rank (no data-parallel group).
@pytest.mark.parametrize("n, algs, buckets, models, layouts, per_node", [
    (3, "ring,tree,recursive_doubling", "0.001", "mlp,gpt", "zero1,zero3,zero3r", None),
    (2, "recursive_doubling,auto", "4", "mlp", "zero2+bf16,diloco,bf16,clip,zero2+bf16+clip",
     None),
    (4, "hierarchical,ring", "4", "mlp", "zero2,fp16,zero3+fp16", 2),
    (2, "ring", "4", "mlp,gpt", "c-fp16,c-qsgd,c-threshold", None),
    (3, "ring,auto", "4", "cnn", "syncbn,syncbn+local-sgd", None),
    (4, "ring", "4", "cnn", "pp2-1f1b-3-rc-bn,pp2-interleaved:2-4-bn+zero1", None),
    (3, "ring", "4", "mlp,gpt", "psc-onebit,psc-dgc,psc-qsgd,hogwild,hogwild-2,c-onebit,"
     "c-randomk,c-powersgd,c-dgc,local-sgd,pp3-gpipe-3,pp3-interleaved:2-3", None),
    (5, "ring,tree,recursive_doubling", "4", "mlp,gpt", "groups2-sync,groups4-async", None),
    (4, "ring,auto", "0.001,4", "mlp,gpt", "tp2", 2),
    (3, "recursive_doubling,mpi", "4", "mlp", "tp3", None),
    (4, "ring,hierarchical", "0.001,4", "mlp,gpt", "pp2,pp2-async-2", 2),
    (4, "ring,tree", "4", "mlp,gpt", "pp2-1f1b-2-t2,pp2-interleaved:2-4-t2,pp4-zb-4,ps-sync,"
     "ps-async,ps-backup-2", None),
    (4, "ring", "4", "mlp", "tp2+zero1,tp2+zero3r,pp2-1f1b-2+zero2,"
     "pp2-zb-3-rc+zero3,pp2-interleaved:2-4+zero3,pp2-gpipe-2-fp16+zero3,"
     "pp2-interleaved:2-4-bf16,tp2+zero1+clip,pp2-1f1b-2-t2+clip", None),
    (4, "ring", "0.001", "gpt", "tp2+zero3,pp2-interleaved:2-4-tied,pp2-1f1b-2-t2-tied,"
     "pp2-zb-4-tiedstep", None),
    (3, "ring", "0.001,4", "cnn", "hybrid,hybrid+syncbn,hybrid+clip", None),
    (3, "ring", "0.001,4", "gpt,mlp", "parallax-sync,parallax-async", None),
])
def test_other_layouts_traffic_equals_counters(n, algs, buckets, models, layouts, per_node):
    """ZeRO stages 1-3 (reduce-scatter or all-reduce per bucket, all-gathers of shards
    after the update or before every pass), model averaging (one all-reduce of the
    parameters per period), 2-byte mixed-precision buckets, compression (all-reduced
    or all-gathered payloads, PowerSGD's rounds), synchronized BatchNorm (the cnn's
    statistics all-reduced in every pass), the parameter server (``ps-MODE[-S]``:
    each worker's pushes and each server's answers, pickled headers included; with
    compression, ``psc-NAME``, the compressed payloads and their contexts; Hogwild,
    ``hogwild-S``: a worker's one-sided reads, adds and version fetches; worker
    groups, ``groupsG-MODE``: a group's all-reduce and broadcasts, its leader's pushes)
    and tensor
    parallelism (``tpT``: the tp group's all-reduces in the passes, the dp group's buckets
    of the slices; uneven at T = 3) and pipeline parallelism (``ppP-SCHEDULE-M``: each
    stage's sends and receives of activations and gradients, walking the schedule, and
    its dp group's buckets of its layers; ``-tied``: a tied weight's copy to the head's
    stage and its gradients back, ``-tiedstep`` their sum once a step; ``-bn``: each
    stage's BatchNorms synchronized over its dp group, ``--sync-bn``) and the conv-DP/FC-MP hybrid (``hybrid``: the
    boundary's all-gathers and reduce-scatter, the FC block's all-reduces, the
    convolutions' buckets; uneven FC slices at p = 3) and Parallax (``parallax-MODE``:
    gpt-tiny's Embedding, or the mlp's biases, pushed to the servers as coalesced rows or
    whole, the rest all-reduced among the trainers), and ``--clip-grad-norm`` (``+clip``:
    its two MPI all-reduces on each group that sums the norm: tp, pp, hybrid, ZeRO's dp;
    none under plain data parallelism), counted exactly, group by group."""
    check_ranks(n, algs, buckets, models, per_node=per_node, layouts=layouts)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_other_layouts_grid(n):
    check_ranks(n, ALL, "0.001,4", layouts=LAYOUTS + "," + COMPRESSORS, timeout=2400)
    check_ranks(n, ALL, "4", "cnn", layouts="syncbn,syncbn+local-sgd,syncbn+zero3",
                timeout=2400)
    ps = "ps-sync,ps-async,ps-ssp,ps-backup,ps-softsync" + (",ps-sync-2,ps-async-3"
                                                            if n > 3 else "")
    check_ranks(n, "ring", "4", layouts=ps, timeout=2400)
    check_ranks(n, "ring", "4", layouts=COMPRESSORS.replace("c-", "psc-").replace(
        ",psc-powersgd", ""), timeout=2400)
    check_ranks(n, "ring", "4", layouts="hogwild" + (",hogwild-2" if n > 2 else "")
                + (",hogwild-3" if n > 3 else ""), timeout=2400)
    groups = {3: "groups2-sync,groups2-async", 4: "groups3-sync,groups3-ssp",
              8: "groups7-sync,groups3-sync-2"}.get(n)  # (2 ranks: one worker, no group)
    if groups:
        check_ranks(n, ALL, "0.001,4", layouts=groups, timeout=2400)
    tp = {2: "tp2", 3: "tp3", 4: "tp2,tp4", 8: "tp2,tp4,tp8"}[n]
    check_ranks(n, ALL.replace(",hierarchical", "") if n == 3 else ALL, "0.001,4",
                "mlp", layouts=tp, timeout=2400)
    if n % 2 == 0:
        check_ranks(n, ALL, "0.001,4", "gpt", layouts="tp2", timeout=2400)
    pp = {2: "pp2,pp2-gpipe-3,pp2-interleaved:2-4,pp2-zb-4,pp2-async-1",
          3: "pp3,pp3-gpipe-1,pp3-interleaved:2-3,pp3-zb-3,pp3-async-2",
          4: "pp2,pp4-1f1b-4,pp2-interleaved:2-4,pp4-zb-5,pp2-async-3",
          8: "pp2,pp4-1f1b-4,pp4-gpipe-2,pp2-interleaved:3-4,pp4-zb-4,pp4-async-3"}[n]
    check_ranks(n, ALL.replace(",hierarchical", "") if n == 3 else ALL, "0.001,4",
                "mlp,gpt", layouts=pp, timeout=2400)
    three_d = {4: "pp2-1f1b-2-t2,pp2-interleaved:2-4-t2,pp2-async-2-t2",
               8: "pp2-1f1b-2-t2,pp4-async-3-t2,pp2-interleaved:2-4-t2"}.get(n)
    if three_d:  # (pipeline x tensor x data parallelism: 3-D)
        check_ranks(n, ALL, "0.001,4", "mlp,gpt", layouts=three_d, timeout=2400)
    if n == 8:
        check_ranks(n, ALL, "0.001,4", "mlp", layouts="pp2-zb-3-t4", timeout=2400)
    if n in (4, 8):  # (ZeRO on the dp group of tensor, pipeline and 3-D layouts)
        check_ranks(n, ALL, "0.001,4", "mlp,gpt", layouts="tp2+zero1,tp2+zero2,tp2+zero3,"
                    "tp2+zero3r,pp2-1f1b-2+zero1,pp2-zb-2+zero2,pp2-gpipe-2+zero3,"
                    "pp2-interleaved:2-4+zero1,pp2-interleaved:2-4+zero3"
                    + (",pp2-1f1b-2-t2+zero1,pp2-interleaved:2-4-t2+zero3" if n == 8 else ""), timeout=2400)
    check_ranks(n, ALL.replace(",hierarchical", "") if n == 3 else ALL, "0.001,4", "cnn",
                layouts="hybrid,hybrid+syncbn", timeout=2400)
    parallax = "parallax-sync,parallax-async,parallax-ssp" + (",parallax-sync-2"
                                                              if n > 3 else "")
    check_ranks(n, ALL.replace(",hierarchical", ""), "0.001,4", "gpt,mlp", layouts=parallax,
                timeout=2400)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_predicted_traffic_equals_counters_grid(n):
    check_ranks(n, ALL, "0.001,0.5,4", timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("n, per_node", [(3, 2), (4, 2), (8, 2), (8, 3)])
def test_hierarchical_over_nodes_grid(n, per_node):
    check_ranks(n, "hierarchical,recursive_doubling,ring", "0.001,4", per_node=per_node,
                timeout=900)


def simulate(*args, timeout=120):
    return run_command(MPIDL + ["simulate", *map(str, args)], timeout=timeout)


def json_of(launch):
    lines = [line for line in launch.output.splitlines() if line.startswith("{")]
    assert len(lines) == 1, launch.output
    return json.loads(lines[0])


def test_json_bytes_mean_what_the_metrics_mean():
    """For the ring, a rank's bytes per step averaged over the ranks is the epoch line's
    ``bytes_sent_per_step`` (``FusedAllreduce.bytes_per_step``: 2 (p - 1)/p of the
    buckets); every rank's own figure is listed too."""
    from mpidl.engine.models import build_model

    out = json_of(simulate("--model", "mlp", "--ranks", "2,3,5", "--algorithm", "ring",
                           "--limit-train", "512", "--json").check())
    dense = sum(q.data.nbytes for _, q in build_model("mlp").named_parameters())
    assert [r["ranks"] for r in out["predictions"]] == [2, 3, 5]
    for row in out["predictions"]:
        p = row["ranks"]
        assert row["bytes_per_step"] == pytest.approx(dense * 2 * (p - 1) / p, rel=1e-12)
        assert len(row["per_rank"]["bytes"]) == p
        assert row["counters"]["allreduce"]["bytes"] == row["per_rank"]["bytes"][0]
        assert row["steps_per_epoch"] == -(-512 // (out["batch_size"] * p))


def test_json_of_tensor_parallelism():
    """--tensor-parallel 2 on 4 ranks, the ring: a rank's tp group carries each micro-
    batch's all-reduces (at T = 2 the ring sends each one's size once), its dp group
    2 (D - 1)/D of the slices it holds; rank counts T does not divide are left out; one
    process is the efficiency's baseline (a rank's share of the samples: 1/T of a dp
    group's)."""
    out = json_of(simulate("--model", "mlp", "--tensor-parallel", "2", "--algorithm", "ring",
                           "--accumulate", "2", "--ranks", "1,2,3,4", "--limit-train", "512",
                           "--compute-s-per-sample", "1e-4", "--json").check())
    assert [r["ranks"] for r in out["predictions"]] == [2, 4]
    row = out["predictions"][-1]
    groups = row["counters"]["groups"]
    tp_calls = row["tp_calls"]
    assert groups["tp"]["allreduce"]["calls"] == 2 * len(tp_calls)  # 2 micro-batches
    assert groups["tp"]["allreduce"]["bytes"] == 2 * sum(
        c["bytes"] for c in tp_calls if c["algorithm"] != "mpi")
    dense = sum(c["bytes"] for c in row["calls"])  # (tp rank 0's slices, in buckets)
    assert groups["dp"]["allreduce"]["bytes"] == dense  # 2 (D - 1)/D at D = 2
    assert row["counters"]["total"]["bytes"] == sum(
        groups[g]["total"]["bytes"] for g in ("tp", "dp"))
    assert row["steps_per_epoch"] == -(-512 // (out["batch_size"] * 2 * 2))
    assert 0 < row["efficiency"] <= 1


def test_json_of_pipeline_parallelism():
    """--pipeline-stages 2 with 4 micro-batches on 4 ranks, the ring: each stage sends one
    message per micro-batch to the other (activations forward, gradients back) and
    receives one; its dp group 2 (D - 1)/D of its layers' parameters; the cut is the
    runtime's over the costs given; one process is the efficiency's baseline (a rank's
    share of the samples: 1/P of a replica's)."""
    from mpidl.engine.models import build_model
    from mpidl.runtime.pipeline import partition

    costs = "1,1,1,1,1,1"
    out = json_of(simulate("--model", "mlp", "--pipeline-stages", "2", "--micro-batches",
                           "4", "--algorithm", "ring", "--ranks", "1,2,3,4",
                           "--stage-costs", costs, "--limit-train", "512",
                           "--compute-s-per-sample", "1e-4", "--json").check())
    assert [r["ranks"] for r in out["predictions"]] == [2, 4]
    row = out["predictions"][-1]
    cut = row["pipeline"]
    assert cut["bounds"] == partition([1.0] * 6, 2) and cut["stage_messages"] == [4, 4]
    model = build_model("mlp")
    first = [q for n, q in model.named_parameters() if int(n.split(".")[0]) < cut["bounds"][1]]
    groups = row["counters"]["groups"]
    assert groups["pp"]["p2p"] == {"calls": 8, "messages": 4,
                                   "bytes": 4 * cut["boundary_bytes"][0], "native_calls": 0}
    assert groups["dp"]["allreduce"]["bytes"] == sum(q.data.nbytes for q in first)
    assert row["steps_per_epoch"] == -(-512 // (out["batch_size"] * 4 * 2))
    assert 0 < row["efficiency"] <= 1 and 0 < cut["bubble"] < 1


def test_json_of_the_hybrid():
    """--hybrid conv-dp-fc-mp on the cnn, the ring: a rank's bytes per step are the
    runtime's own formula (``Hybrid.bytes_per_step``, what its start line prints) at
    every rank count, even and uneven FC slices alike."""
    from mpidl.data import load_dataset
    from mpidl.engine.models import build_model
    from mpidl.runtime.hybrid import Hybrid, buckets_bytes
    from mpidl.simulate.tensor import RecordingGroup

    out = json_of(simulate("--model", "cnn", "--hybrid", "conv-dp-fc-mp", "--algorithm",
                           "ring", "--ranks", "2,3,4", "--batch-size", "8", "--limit-train",
                           "512", "--json").check())
    assert out["layout"] == "hybrid conv-dp-fc-mp"
    label_bytes = load_dataset("fashion-mnist", None, 512, 64).train_y.itemsize
    for row in out["predictions"]:
        p = row["ranks"]
        model = build_model("cnn")
        part = Hybrid(p, "ring")
        part.setup(model, RecordingGroup(0, p, None))
        part._label_itemsize = lambda: label_bytes
        conv = sum(q.data.size for n, q in model.named_parameters() if not part.in_fc(n))
        want = [buckets_bytes([(conv, 4)], p, r) + sum(part._fc_terms([8] * p, r).values())
                for r in range(p)]  # (the convolutions fit one 4 MiB bucket)
        assert row["per_rank"]["bytes"] == want, (p, row["per_rank"]["bytes"], want)


def test_json_of_worker_groups():
    """--strategy ps --group-size 2 on 5 ranks (1 server, 2 groups of 2), the ring: the
    server answers the 2 leaders only; a group's ranks all-reduce every gradient alike
    and the leader broadcasts the parameters (``auto``: MPI's own broadcast by default,
    calls only), so a leader sends a member's bytes plus its push (every gradient and a
    header)."""
    from mpidl.engine.models import build_model

    out = json_of(simulate("--model", "mlp", "--strategy", "ps", "--group-size", "2",
                           "--algorithm", "ring", "--ranks", "4,5", "--limit-train", "512",
                           "--json").check())
    assert [r["ranks"] for r in out["predictions"]] == [5]
    params = build_model("mlp").named_parameters()
    dense = sum(q.data.nbytes for _, q in params)
    row = out["predictions"][0]
    msgs, nbytes = row["per_rank"]["messages"], row["per_rank"]["bytes"]
    assert msgs[0] == 2 * (1 + len(params))           # the server answers 2 leaders
    assert nbytes[2] == nbytes[4] and nbytes[1] == nbytes[3]  # leaders alike, members alike
    assert 0 < nbytes[1] - nbytes[2] - dense < 2000   # + the push (and a header)
    assert "worker groups of 2" in out["layout"]


def test_json_of_parallax():
    """--sparse-sync ps with the mlp's biases on 1 server (--ps-params), 3 trainers, the
    ring: a trainer pushes a header and every bias and all-reduces the weights among the
    trainers (2 (D - 1)/D of them); the server answers each trainer with a header and
    the biases."""
    from mpidl.engine.models import build_model

    out = json_of(simulate("--model", "mlp", "--sparse-sync", "ps", "--ps-params", "*.bias",
                           "--algorithm", "ring", "--ranks", "4", "--limit-train", "512",
                           "--json").check())
    assert out["layout"].startswith("Parallax (1 server(s) hold *.bias")
    params = build_model("mlp").named_parameters()
    biases = sum(q.data.nbytes for n, q in params if n.endswith(".bias"))
    weights = sum(q.data.nbytes for n, q in params if n.endswith(".weight"))
    row = out["predictions"][0]
    msgs, nbytes = row["per_rank"]["messages"], row["per_rank"]["bytes"]
    assert msgs[0] == 3 * 4 and 0 < nbytes[0] - 3 * biases < 3 * 200  # (pickled headers)
    for b in nbytes[1:]:  # (+ a pickled header; the ring's uneven chunks: a few bytes)
        assert 0 < b - biases - weights * 4 / 3 < 300, (b, biases, weights)
    assert row["steps_per_epoch"] == -(-512 // (out["batch_size"] * 3))


def test_json_of_the_parameter_server():
    """--strategy ps: a worker sends every gradient once (one header per server), a
    server its shard to every worker; the servers (sharded largest first) hold every
    parameter once between them; rank counts without a worker are left out."""
    from mpidl.engine.models import build_model

    out = json_of(simulate("--model", "mlp", "--strategy", "ps", "--servers", "2",
                           "--ranks", "1,2,3,4,5", "--limit-train", "512", "--json").check())
    params = build_model("mlp").named_parameters()
    dense = sum(q.data.nbytes for _, q in params)
    assert [r["ranks"] for r in out["predictions"]] == [3, 4, 5]
    for row in out["predictions"]:
        p = row["ranks"]
        msgs, nbytes = row["per_rank"]["messages"], row["per_rank"]["bytes"]
        assert msgs[2:] == [2 + len(params)] * (p - 2)           # 2 headers + every array
        assert all(0 < b - dense < 2000 for b in nbytes[2:])      # + 2 pickled headers
        assert sum(nbytes[:2]) - (p - 2) * dense == pytest.approx(0, abs=2000 * (p - 2))
        assert msgs[0] + msgs[1] == (p - 2) * (2 + len(params))
        assert row["steps_per_epoch"] == -(-512 // (out["batch_size"] * (p - 2)))  # workers


@pytest.mark.parametrize("flags, factor", [
    (["--zero", "1"], 2), (["--zero", "2"], 2), (["--zero", "3"], 3),
    (["--sync", "local-sgd", "--period", "8"], 2 / 8),
    (["--sync", "diloco", "--period", "4", "--warmup-steps", "10"], 2 / 4),
    (["--precision", "bf16"], 2), (["--zero", "2", "--precision", "bf16"], 2),
    (["--zero", "3", "--precision", "fp16"], 3),
])
def test_json_bytes_of_other_layouts(flags, factor):
    """With the ring, a rank's bytes per step averaged over the ranks follow the
    formulas: ZeRO stages 0-2 2(p - 1)/p of the parameters' bytes, stage 3 3(p - 1)/p
    (issue 15 point 3); model averaging the all-reduce's over its period; bfloat16
    buckets half of float32's (2(p - 1)/p of 2-byte words), under ZeRO too (fp16's
    overflow agreement is MPI's own all-reduce: calls, not counted bytes)."""
    from mpidl.engine.models import build_model

    out = json_of(simulate("--model", "mlp", "--ranks", "2,3,5", "--algorithm", "ring",
                           "--limit-train", "512", "--json", *flags).check())
    dense = sum(q.data.nbytes for _, q in build_model("mlp").named_parameters())
    if "--precision" in flags:
        dense //= 2
    for row in out["predictions"]:
        p = row["ranks"]
        assert row["bytes_per_step"] == pytest.approx(dense * factor * (p - 1) / p,
                                                      rel=1e-12), (flags, p)
    assert out["layout"] != "data parallelism"


def test_compressor_work_is_priced_at_the_machines_gamma():
    """The compressors' work, timed in the predicting process alone, is priced at the
    machine's gamma over that process's (ranks sharing a node's cores and memory, or
    another machine); without either gamma it stays as timed. The layout records the
    gamma of the process that timed it, and a momentum-correcting memory takes the run's
    SGD momentum over, as the runtime's does."""
    from types import SimpleNamespace

    import numpy as np

    from mpidl.compress import Exchanger, build_compression
    from mpidl.engine import build_model
    from mpidl.simulate import step as st
    from mpidl.simulate.collectives import Links, Topology
    from mpidl.simulate.compression import _Loopback, layout
    from mpidl.simulate.machine import Machine

    model = build_model("mlp", hidden=(64,))
    named = model.named_parameters()
    rng = np.random.default_rng(0)
    grads = {n: rng.standard_normal(q.data.shape).astype(np.float32) for n, q in named}
    compute = st.Compute({"1": (1e-6, 2e-6)}, update_s=1e-3)
    timed = layout(st.StepLayout(2), named, grads, "dgc", 0.01, st.auto.Selector(2, {}),
                   "ring", 4.0, momentum=0.9)
    assert timed.local_gamma > 0
    local = sum(c.local_s for c in timed.calls)
    assert local > 0
    for gamma, scale in ((0.0, 1.0), (timed.local_gamma, 1.0), (3 * timed.local_gamma, 3.0)):
        machine = Machine(alpha_intra=1e-6, beta_intra=1e-9, gamma=gamma)
        links = Links(machine, Topology(2, 2))
        t = st.step_time(timed, compute, 32, 1, links, overlap=False)
        assert t["compression"] == pytest.approx(local * scale, rel=1e-12), (gamma, t)
    exchanger = Exchanger(_Loopback(2), build_compression("dgc", 0.01))
    assert exchanger.adopt_momentum(SimpleNamespace(momentum=0.9)) == 0.9


@pytest.mark.parametrize("spec, ratio", [("onebit", None), ("dgc", 0.01), ("fp16", None),
                                         ("powersgd", None)])
def test_compressor_seconds_run_the_exchanger(spec, ratio):
    """The compressors' own seconds come from the runtime's ``Exchanger`` run over a
    loopback group (frames packed, every rank's payload decoded, the mean restored): it
    runs every kind of exchange (gathered frames, summable payloads, multi-round), times
    each tensor, and its means are those of equal ranks: at p = 2 the same bits as one
    rank's own round trip (x + x and 2x / 2 are exact)."""
    import numpy as np

    from mpidl.compress import Exchanger, build_compression
    from mpidl.simulate.compression import _Loopback, exchange_seconds

    rng = np.random.default_rng(0)
    tensors = [("w", rng.standard_normal((64, 33)).astype(np.float32)),
               ("b", rng.standard_normal(33).astype(np.float32))]
    seconds = exchange_seconds(spec, ratio, tensors, 2, repeats=2, seconds=0.0)
    assert set(seconds) == {"w", "b"} and all(s > 0 for s in seconds.values()), seconds
    one, two = (Exchanger(_Loopback(p), build_compression(spec, ratio)) for p in (1, 2))
    for name, g in tensors:
        a, b = one.exchange(g, name), two.exchange(g, name)
        assert a.shape == g.shape and a.dtype == g.dtype
        assert np.array_equal(a, b), (spec, name)


def test_scaling_to_4096_ranks(tmp_path):
    """A described cluster (8 ranks per node, 200 Gbit/s): the curve to 4096 ranks comes
    back quickly, efficiency falls as ranks are added and the point below 50 % is named."""
    machine = tmp_path / "cluster.json"
    machine.write_text(json.dumps({"name": "test cluster", "ranks_per_node": 8,
                                   "alpha_intra": 2e-6, "beta_intra": 1e-11,
                                   "alpha_inter": 5e-6, "beta_inter": 8 / 200e9,
                                   "gamma": 1e-11}))
    out = json_of(simulate("--model", "mlp", "--ranks", "1-4096", "--machine", machine,
                           "--compute-s-per-sample", "2e-6", "--algorithm", "ring", "--json",
                           "--limit-train", "512", "--plot", tmp_path / "eff.png").check())
    rows = out["predictions"]
    assert [r["ranks"] for r in rows] == [1 << k for k in range(13)]
    eff = [r["efficiency"] for r in rows]
    assert eff[0] == 1.0 and all(a >= b for a, b in zip(eff, eff[1:])), eff
    below = out["efficiency_below_50pct_at"]
    assert below == next(r["ranks"] for r in rows if r["efficiency"] < 0.5)
    assert rows[-1]["nodes"] == 512 and (tmp_path / "eff.png").stat().st_size > 0


def test_calibrate_then_predict(tmp_path):
    machine = tmp_path / "here.json"
    launch = run_ranks(2, ["-m", "mpidl.cli.main", "simulate", "--calibrate", "--model",
                           "logreg", "--batch-size", "16", "--limit-train", "256",
                           "--machine", str(machine)], module_mpi4py=False, timeout=180)
    launch.check()
    assert "written to" in launch.output and launch.output.count("alpha") == 1, launch.output
    data = json.loads(machine.read_text())
    assert data["alpha_intra"] > 0 and data["beta_intra"] > 0 and data["gamma"] > 0
    assert set(data["compute"]["logreg"]["layers"]) == {"0", "1"}
    out = json_of(simulate("--model", "logreg", "--batch-size", "16", "--machine", machine,
                           "--limit-train", "256", "--ranks", "2", "--json").check())
    row = out["predictions"][0]
    assert out["bytes_per_step"] == row["bytes_per_step"] and out["ranks"] == 2
    assert out["compute"].startswith("measured") and row["time_s"]["forward"] > 0
    assert row["step_s"] >= row["time_s"]["forward"] + row["time_s"]["backward"]


def test_measured_curve_prices_messages(tmp_path):
    """A calibrated link is priced by its measured curve (linear between the sizes, the
    last slope beyond them), not by the fitted line; an ``--alpha-*``/``--beta-*``
    override moves or rescales the curve (the same value changes nothing)."""
    from mpidl.simulate.collectives import Links, Topology
    from mpidl.simulate.machine import Machine

    curve = {"bytes": [1, 1024, 1 << 20, 1 << 21], "seconds": [2e-5, 3e-5, 2e-3, 4.5e-3]}
    m = Machine(alpha_intra=1e-5, beta_intra=1e-9, alpha_inter=1e-5, beta_inter=1e-9,
                info={"points": {"inter": curve}})
    links = Links(m, Topology(2, 1))
    assert links.cost(True, 1 << 20) == pytest.approx(2e-3, rel=1e-12)
    assert links.cost(True, 3 << 19) == pytest.approx((2e-3 + 4.5e-3) / 2, rel=1e-12)
    assert links.cost(True, 2 << 20, messages=2) == pytest.approx(4e-3, rel=1e-12)
    assert links.cost(True, 4 << 20) == pytest.approx(4.5e-3 + 5e-3, rel=1e-12)
    assert links.cost(True, 0, messages=3) == pytest.approx(6e-5, rel=1e-12)
    assert links.message(False, 1 << 20) == pytest.approx(1e-5 + 1e-9 * (1 << 20))
    machine = tmp_path / "m.json"
    machine.write_text(json.dumps(m.to_dict()))

    def step(*flags):
        out = json_of(simulate("--model", "mlp", "--machine", machine, "--ranks", "2",
                               "--ranks-per-node", "1", "--algorithm", "ring", "--json",
                               "--limit-train", "512", *flags).check())
        return out["predictions"][0]["time_s"]["comm"]

    same, base, slower = step("--beta-inter", "1e-9"), step(), step("--beta-inter", "2e-9")
    assert same == pytest.approx(base, rel=1e-12)
    assert slower > base * 1.4, (base, slower)


# also run as a process of its own (test_bad_input_from_its_own_process_is_one_line)
SPARSE_UNDER_ZERO = (["--zero", "1", "--model", "gpt-tiny", "--dataset", "text"],
                     ["--zero 1", "row-sparse", "--sparse-grads dense"])

BAD_INPUT = [
    (["--ranks", "0"], ["--ranks '0'", "rank count >= 1"]),
    (["--algorithm", "fast"], ["--algorithm", "fast"]),
    (["--strategy", "hogwild", "--ranks", "3"], ["plain SGD only", "--momentum 0"]),
    (["--strategy", "hogwild", "--momentum", "0", "--compression", "topk", "--ranks", "3"],
     ["--compression topk with --strategy hogwild is not modelled yet"]),
    (["--strategy", "ps", "--group-size", "2", "--ranks", "2,4"],
     ["--group-size 2 does not divide the 1 worker(s)"]),
    (["--strategy", "ps", "--deal", "portions", "--ranks", "3"],
     ["--deal portions with --strategy ps is not modelled yet", "--servers"]),
    (["--strategy", "ps", "--compression", "topk", "--group-size", "2", "--ranks", "5"],
     ["--compression topk with --group-size 2 is not modelled yet"]),
    (["--strategy", "ps", "--compression", "powersgd", "--ranks", "3"],
     ["--compression powersgd needs all-reduces between the workers"]),
    (["--strategy", "ps", "--servers", "2", "--ranks", "2"], ["--servers", "3 ranks"]),
    (["--strategy", "ps", "--staleness", "2"], ["--staleness applies to --mode ssp"]),
    (["--algorithm", "shared"], ["--algorithm shared is not modelled yet"]),
    (["--pipeline-stages", "2", "--tensor-parallel", "2", "--ranks", "2,6"],
     ["--pipeline-stages 2 x --tensor-parallel 2 divides none"]),
    (["--pipeline-stages", "2", "--tensor-parallel", "2", "--sync", "local-sgd",
      "--ranks", "4"], ["--sync local-sgd with --pipeline-stages is not modelled yet"]),
    (["--pipeline-stages", "2", "--zero", "3", "--schedule", "async", "--micro-batches", "2",
      "--ranks", "4"], ["--pipeline-stages 2 with --zero 3 and --schedule async is not built"]),
    (["--pipeline-stages", "4", "--ranks", "2,6"], ["--pipeline-stages 4 divides none"]),
    (["--pipeline-stages", "8", "--ranks", "8"], ["needs at least 8 top-level layers"]),
    (["--pipeline-stages", "2", "--stage-costs", "1,2"], ["--stage-costs", "6 costs"]),
    (["--pipeline-stages", "4", "--schedule", "async", "--micro-batches", "2", "--ranks",
      "4"], ["--micro-batches M >= 3"]),
    (["--model", "cnn", "--pipeline-stages", "2", "--tensor-parallel", "2", "--sync-bn",
      "--ranks", "8"], ["--sync-bn with --pipeline-stages and --tensor-parallel is not "
                        "modelled yet"]),
    (["--tensor-parallel", "2", "--precision", "bf16", "--ranks", "4"],
     ["--precision bf16 with --tensor-parallel is not modelled yet"]),
    (["--tensor-parallel", "3", "--ranks", "4"], ["--tensor-parallel 3 divides none"]),
    (["--sparse-sync", "ps", "--ranks", "3"], ["no parameter with row-sparse gradients"]),
    (["--sparse-sync", "ps", "--ps-params", "*.bias", "--zero", "1", "--ranks", "3"],
     ["--sparse-sync ps cannot be used with --zero 1"]),
    (["--sparse-sync", "ps", "--ps-params", "*.bias", "--servers", "2", "--ranks", "2"],
     ["--servers", "3 ranks"]),
    (["--hybrid", "conv-dp-fc-mp", "--ranks", "2"], ["no convolution before its first"]),
    (["--model", "cnn", "--hybrid", "conv-dp-fc-mp", "--ranks", "2,256"],
     ["on 256 ranks", "128 output features"]),
    (["--model", "cnn", "--hybrid", "conv-dp-fc-mp", "--zero", "1", "--ranks", "2"],
     ["--hybrid conv-dp-fc-mp with --zero 1"]),
    (["--model", "gpt-tiny", "--dataset", "text", "--heads", "2", "--width", "32",
      "--tensor-parallel", "4", "--ranks", "4"], ["2 attention heads, fewer than the 4"]),
    (["--zero", "1", "--compression", "topk"], ["--zero 1 cannot serve --compression topk"]),
    SPARSE_UNDER_ZERO,
    (["--calibrate"], ["--calibrate", "--machine FILE"]),
    (["--calibrate", "--machine", "m.json"], ["mpiexec -n 2"]),
    (["--ranks", "2", "--ranks-per-node", "0"], ["--ranks-per-node must be >= 1"]),
]


@pytest.fixture(scope="module")
def bad_input_launches():
    """Every BAD_INPUT command through ``mpidl``'s main in one process (a process each
    would start Python and import numpy 33 times for checks that run before any MPI)."""
    return run_cli_cases([["simulate", "--model", "mlp", *args] for args, _ in BAD_INPUT])


@pytest.mark.parametrize("case", range(len(BAD_INPUT)),
                         ids=[" ".join(args) for args, _ in BAD_INPUT])
def test_bad_input_is_one_line(case, bad_input_launches):
    assert_one_line_error(bad_input_launches[case], *BAD_INPUT[case][1])


def test_bad_input_from_its_own_process_is_one_line():
    """The same as a command of its own: one line, exit 2, nothing else."""
    args, needles = SPARSE_UNDER_ZERO
    assert_one_line_error(simulate("--model", "mlp", *args), *needles)


def test_bad_machine_file_is_one_line(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text('{"alpha_intra": -1}')
    assert_one_line_error(simulate("--machine", bad), str(bad), "alpha_intra",
                          "a number >= 0")


@pytest.mark.parametrize("data, needle", [
    ("[1, 2]", "expected a JSON object"),
    ({"beta_inter": "fast"}, "beta_inter must be a number"),
    ({"ranks_per_node": 0}, "ranks_per_node must be an integer >= 1"),
    ({"latency": 1e-6}, "unknown key 'latency'"),
    ({"compute": {"mlp": {"layers": {"1": [1e-6]}}}}, "[forward_s, backward_s]"),
])
def test_machine_file_checks(tmp_path, data, needle):
    from mpidl.errors import ConfigError
    from mpidl.simulate import machine

    path = tmp_path / "m.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(ConfigError) as e:
        machine.load(str(path))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="no such file"):
        machine.load(str(tmp_path / "missing.json"))

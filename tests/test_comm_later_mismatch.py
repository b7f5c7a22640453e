"""A disagreement on a later call (after the tensor's first, fully checked call) ends
in an error naming the call, the tensor and the ranks, under every algorithm — never in
silent garbage, never in a silent hang (check="digest", the default; issue 12, point 3).

The rank script (ranks/comm_later_mismatch.py) makes 1500 calls of two alternating
tensors (the digests are compared before calls 65, 193, 449, 961 and at close());
at call 301 rank 1 passes another dtype, op or shape, or skips a call, or it
skips the very last one. The stall inspector runs with a 2 s warning and a 5 s timeout,
so a rank stuck in MPI is named and the job ends.
"""

import os
import re
import time

import pytest

from mpirun import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ranks", "comm_later_mismatch.py")
ALGORITHMS = ("ring", "tree", "recursive_doubling", "mpi")
STALL = {"MPIDL_STALL_WARNING": "2", "MPIDL_STALL_TIMEOUT": "5"}


def launch(case, algorithm):
    t0 = time.perf_counter()
    out = run_ranks(2, [SCRIPT, case, algorithm], timeout=60, env=STALL)
    assert not out.timed_out, out.output
    assert out.returncode != 0, f"a mismatch went unnoticed:\n{out.output}"
    assert "FINISHED" not in out.output, out.output
    return out.output, time.perf_counter() - t0


@pytest.mark.parametrize("algorithm", [  # mpidl's own algorithm and MPI's in CI, as below
    "ring", pytest.param("tree", marks=pytest.mark.slow),
    pytest.param("recursive_doubling", marks=pytest.mark.slow), "mpi"])
@pytest.mark.parametrize("case,rank0,rank1", [
    ("dtype", "tensor='w' size=10 dtype=float32", "tensor='w' size=10 dtype=int32"),
    ("op", "tensor='w' size=10 dtype=float32 op=sum", "dtype=float32 op=max"),
    ("skip", "rank 0: allreduce tensor='w'", "rank 1: allreduce tensor='v'"),
])
def test_later_mismatch_raises_on_every_rank(case, rank0, rank1, algorithm):
    """Caught by the digest comparison before call 449, on both ranks, naming call 301."""
    output, _ = launch(case, algorithm)
    assert output.count("RAISED CollectiveMismatchError: ranks disagree on call 301 on "
                        "group world [ranks 0, 1]") == 2, output
    assert rank0 in output and rank1 in output, output
    assert f"algorithm={algorithm}" in output, output


@pytest.mark.parametrize("algorithm", [  # message truncation: as each MPI reports it
    pytest.param(a, marks=pytest.mark.mpi_matrix_extra) if a in ("ring", "mpi") else a
    for a in ALGORITHMS])
def test_later_shape_mismatch_is_named(algorithm):
    """Another shape fails inside mpidl's algorithms: the rank that receives too much
    names the call and the tensor (MPI's "message truncated"), and the job ends. Under
    MPI's own allreduce the new size is compared before the call (see below)."""
    output, elapsed = launch("shape", algorithm)
    if algorithm == "mpi":
        # MPI's own allreduce would end the job inside MPI (MPICH aborts, whatever the
        # error handler): rank 1 compares its new size first, rank 0 waits in MPI's call,
        # and the stall inspector names both signatures at call 301.
        assert "truncated" not in output, output
        assert re.search(r"ranks disagree on call 301 of group world \[ranks 0, 1\]: rank "
                         r"\d is in allreduce tensor='w' size=1[02] .*, rank \d is in "
                         r"allreduce tensor='w' size=1[02] ", output), output
        assert "size=10" in output and "size=12" in output, output
        assert elapsed < 30, elapsed
        return
    assert "truncated" in output, output
    assert "RAISED CollectiveMismatchError: rank 0: in allreduce tensor='w' size=10" \
        in output, output
    assert "another rank sent more data than this call expects" in output, output
    # The raising rank exits non-zero, and `python -m mpi4py` aborts the job; without it
    # the other rank would be named stuck by its stall inspector and the job aborted.
    assert elapsed < 30, elapsed


@pytest.mark.parametrize("algorithm", [  # each waits out a stall timeout: two in CI
    "ring", pytest.param("tree", marks=pytest.mark.slow),
    pytest.param("recursive_doubling", marks=pytest.mark.slow), "mpi"])
def test_skipped_last_call_names_the_missing_rank(algorithm):
    """Rank 1 skips the last call and goes on to close(): rank 0's stall warning names
    rank 1 and where it is instead; the stall timeout ends the job."""
    output, elapsed = launch("skip-last", algorithm)
    assert ("mpidl: stall: rank 0 has waited 2 s in allreduce tensor='v' size=10 "
            f"dtype=float32 op=sum algorithm={algorithm} (call 1500 on group world "
            "[ranks 0, 1]). Not arrived: rank 1 (at call 1499, waiting in the signature "
            "check of calls 961-1499).") in output, output
    assert "mpidl: stall timeout (5 s, --stall-timeout)" in output, output
    assert elapsed < 30, elapsed


@pytest.mark.parametrize("algorithm", ["ring", "mpi"])
def test_a_known_tensor_at_a_new_size_on_every_rank_is_no_mismatch(algorithm):
    """Every rank passes 'w' at another size from call 301 on: the run finishes (under
    MPI's own allreduce after one full comparison of the new size)."""
    out = run_ranks(2, [SCRIPT, "resize", algorithm], timeout=60, env=STALL)
    out.check()
    assert out.output.count("FINISHED") == 2, out.output


def test_a_call_that_raised_on_one_rank_is_named():
    """Rank 1's call 301 raises inside the algorithm and rank 1 carries on: it has no
    signature of that call, rank 0 has one, and the next comparison names the call and
    says what happened on rank 1 (not a lookup error while the error is being written)."""
    output, _ = launch("raised", "ignored")
    assert "CAUGHT raised on purpose at call 301" in output, output
    assert output.count("RAISED CollectiveMismatchError: ranks disagree on call 301 on "
                        "group world [ranks 0, 1]") == 2, output
    assert "rank 0: allreduce tensor='w' size=10 dtype=float32 op=max" in output, output
    assert "rank 1: a call that raised on this rank" in output, output

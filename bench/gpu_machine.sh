#!/usr/bin/env bash
# bench/gpu_machine.sh - on a fresh GPU machine, set mpidl up and run its GPU tests and
# benchmarks in one call; every log, JSON and PNG goes to OUTDIR.
#
#   bash bench/gpu_machine.sh OUTDIR [STEP...]
#
# Steps (default: all but smoke, tests and bound, in this order):
#   setup          pip install -e . without build isolation (works offline), the MPICH wheel
#                  from .whl/ into /tmp/mpich when it is there
#   smoke          the GPU collectives on 2 staged ranks (tests/ranks/comm_gpu.py, the CUDA
#                  IPC path of algorithm "shared" included); exits 1 if they fail, so that
#                  a short lease is not spent on the rest
#   test-openmpi   pytest -m gpu with the system MPI mpi4py was built for (Open MPI here)
#   test-mpich     pytest -m gpu with the MPICH wheel (MPI4PY_MPIABI=mpich)
#   tests          test-openmpi and test-mpich at the same time (16 cores, one GPU)
#   bound          issue 13: 2 ranks bound to 8 cores each (Open MPI --map-by slot:PE=8,
#                  MPICH -bind-to core:8) each get 8 BLAS threads; tests/test_any_mpi.py's
#                  BLAS-share tests under the system MPI
#   engine         bench/engine.py --device gpu: mlp, cnn, resnet-tiny at batch 128 and 1024
#                  against PyTorch, eager and CUDA-graph replay
#   kernels        bench/kernels.py --device gpu: every CuPy kernel against a device copy
#   ranks          the data-parallel MLP step (mpidl.benchmarks.scaling) on the GPU with 1
#                  rank and with 2 ranks sharing it, under both MPIs, per algorithm (staged
#                  through pinned host memory, or "shared": CUDA IPC), with timelines
#   train          mpidl train --device gpu on Fashion-MNIST: mlp and cnn on 1 rank, eager
#                  and --cuda-graph, and mlp on 2 ranks sharing the GPU (the data from
#                  .gpudata/fashion-mnist or the Debian package)
#
# On a short lease (minutes of device time), one call that stops early if the GPU
# collectives are broken:  bash bench/gpu_machine.sh OUT setup smoke tests ranks bound
# with the MPICH wheel in .whl/ and Fashion-MNIST in .gpudata/fashion-mnist/ (both ignored
# by git: list them in .git/info/exclude and carry them).
#
# Needs python3 with CuPy, mpi4py, Numba and pytest (PyTorch for the engine's anchor).
# No network is needed. Knobs: PYTHON (python3), MPIDL_GPU_TEST_ARGS (extra pytest args),
# MPIDL_GPU_RANK_SPECS (the ranks step's RANKS:ALGORITHM runs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash bench/gpu_machine.sh OUTDIR [STEP...]}
shift
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STEPS=${*:-setup test-openmpi test-mpich engine kernels ranks train}
export PYTHONUNBUFFERED=1
# Open MPI refuses root and oversubscription unless told
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ -d .gpudata ]; then export MPIDL_DATA_DIR=$PWD/.gpudata; fi

say() { printf '[gpu_machine %s] %s\n' "$(date +%T)" "$*"; }

mpich_env() {
  env LD_LIBRARY_PATH=/tmp/mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
      MPI4PY_MPIABI=mpich PATH=/tmp/mpich/bin:$PATH "$@"
}

for step in $STEPS; do
  case $step in
    setup)
      say "setup: $($PY -V), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1)"
      $PY -m pip install -q --no-deps --no-build-isolation --use-pep517 -e . >"$OUT/setup.log" 2>&1 \
        || { say "pip install -e . failed:"; tail -5 "$OUT/setup.log"; }
      if ls .whl/mpich-*.whl >/dev/null 2>&1; then
        # the wheel's data files (bin/mpiexec, lib/libmpi.so) land under the prefix itself
        $PY -m pip install -q --no-deps --prefix /tmp/mpich .whl/mpich-*.whl >>"$OUT/setup.log" 2>&1
        [ -x /tmp/mpich/bin/mpiexec ] || say "MPICH wheel: no /tmp/mpich/bin/mpiexec"
      fi
      $PY -c "import cupy, mpi4py, numba; from mpi4py import MPI; print('cupy', cupy.__version__, 'mpi4py', mpi4py.__version__, MPI.Get_library_version().splitlines()[0])" 2>&1 | tee -a "$OUT/setup.log"
      ;;
    smoke)
      [ -x /tmp/mpich/bin/mpiexec ] && launch=mpich_env || launch=env
      say "smoke: the GPU collectives on 2 staged ranks"
      if ! $launch MPIDL_CUDA_AWARE=0 timeout 100 mpiexec -n 2 $PY tests/ranks/comm_gpu.py \
          >"$OUT/smoke.log" 2>&1; then
        say "SMOKE FAILED:"; tail -30 "$OUT/smoke.log"; exit 1
      fi
      say "smoke: $(tail -1 "$OUT/smoke.log")"
      ;;
    tests)
      bash bench/gpu_machine.sh "$OUT" test-openmpi >"$OUT/step_test_openmpi.txt" 2>&1 &
      bash bench/gpu_machine.sh "$OUT" test-mpich
      wait
      cat "$OUT/step_test_openmpi.txt"
      grep -hE "^(FAILED|ERROR)" "$OUT"/test_*.log | head -30
      ;;
    bound)
      say "ranks bound to 8 cores: the BLAS threads each gets (first line of mpidl train)"
      train=(-m mpidl train --model mlp --dataset synthetic --epochs 1 --limit-train 512
             --limit-test 64 --no-progress)
      timeout 120 mpiexec --bind-to core --map-by slot:PE=8 -n 2 $PY "${train[@]}" \
        --out-dir /tmp/mpidl-runs/bound-ompi 2>&1 | grep -o "BLAS threads[^|]*" | sed 's/^/  system MPI: /'
      if [ -x /tmp/mpich/bin/mpiexec ]; then
        mpich_env timeout 120 mpiexec -bind-to core:8 -n 2 $PY "${train[@]}" \
          --out-dir /tmp/mpidl-runs/bound-mpich 2>&1 | grep -o "BLAS threads[^|]*" | sed 's/^/  MPICH: /'
      fi
      timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_any_mpi.py tests/test_threads.py \
        -k "blas or share" >"$OUT/bound.log" 2>&1
      say "BLAS-share tests, system MPI: $(tail -1 "$OUT/bound.log")"
      ;;
    test-openmpi)
      say "pytest -m gpu, system MPI"
      timeout 280 $PY -m pytest -m gpu -q -rfEs -p no:cacheprovider ${MPIDL_GPU_TEST_ARGS:-} \
        >"$OUT/test_openmpi.log" 2>&1
      say "rc=$? $(tail -1 "$OUT/test_openmpi.log")"
      ;;
    test-mpich)
      [ -x /tmp/mpich/bin/mpiexec ] || { say "no MPICH wheel installed: skipped"; continue; }
      say "pytest -m gpu, MPICH wheel"
      mpich_env timeout 280 $PY -m pytest -m gpu -q -rfEs -p no:cacheprovider ${MPIDL_GPU_TEST_ARGS:-} \
        >"$OUT/test_mpich.log" 2>&1
      say "rc=$? $(tail -1 "$OUT/test_mpich.log")"
      ;;
    engine)
      say "bench/engine.py --device gpu"
      timeout 300 $PY bench/engine.py --device gpu --out "$OUT/engine_gpu.json" \
        --plot "$OUT/engine_gpu.png" 2>&1 | grep -v Warning
      ;;
    kernels)
      say "bench/kernels.py --device gpu"
      timeout 240 $PY bench/kernels.py --device gpu --rounds 5 --out "$OUT/kernels_gpu.json" 2>&1 \
        | tail -40
      ;;
    ranks)
      say "data-parallel MLP on the GPU: 1 rank, 2 ranks sharing it (staged) per algorithm, both MPIs"
      runs=()
      for mpi in openmpi mpich; do
        if [ $mpi = mpich ]; then [ -x /tmp/mpich/bin/mpiexec ] || continue; launch=mpich_env; else launch=env; fi
        for spec in ${MPIDL_GPU_RANK_SPECS:-1:auto 2:auto 2:shared 2:mpi 2:ring 2:recursive_doubling}; do
          n=${spec%%:*} alg=${spec#*:} tag=${mpi}_${n}_${alg}
          extra=()
          [ $alg = auto ] && extra=(--timeline "$OUT/timeline_${tag}_{rank}.json")
          $launch timeout 120 mpiexec -n $n $PY -m mpidl.benchmarks.scaling mpidl --device gpu \
            --steps 300 --warmup 20 --algorithm $alg "${extra[@]}" --out "$OUT/ranks_$tag.json" \
            >"$OUT/ranks_$tag.log" 2>&1 || say "$tag failed: $(tail -2 "$OUT/ranks_$tag.log")"
        done
      done
      $PY - "$OUT" <<'PYEOF'
import glob, json, os, sys
out = sys.argv[1]
runs = {}
for path in sorted(glob.glob(os.path.join(out, "ranks_*.json"))):
    r = json.load(open(path))
    tag = os.path.basename(path)[6:-5]
    keep = ("ranks", "algorithm", "auto_resolves_to", "images_per_sec", "step_ms_median", "compute_ms", "wait_ms",
            "forward_ms", "backward_ms", "update_ms", "timeline_comm_ms", "hidden",
            "staged_copy_ms", "staged_wire_ms", "copies_under_transfers")
    runs[tag] = {k: r[k] for k in keep if k in r}
    print(f"{tag:34s} ({r.get('auto_resolves_to') or '-':>8s}) {r['images_per_sec']:9,.0f} images/s  step {r['step_ms_median']:6.2f} ms "
          f"(compute {r.get('compute_ms', 0):.2f}, wait {r.get('wait_ms', 0):.2f})")
json.dump({"benchmark": "gpu_ranks", "model": "MLP 784-1024-1024-10, batch 128 per rank",
           "command": "mpiexec -n N python -m mpidl.benchmarks.scaling mpidl --device gpu "
                      "--steps 300 --warmup 20 --algorithm ALG", "runs": runs},
          open(os.path.join(out, "gpu_ranks.json"), "w"), indent=1)
PYEOF
      ;;
    train)
      say "mpidl train --device gpu on Fashion-MNIST: 1 rank eager and with --cuda-graph, 2 ranks"
      for spec in "mlp:1:" "mlp:1:--cuda-graph" "cnn:1:" "cnn:1:--cuda-graph" "mlp:2:"; do
        IFS=: read -r model n flag <<<"$spec"
        echo "== $model, $n rank(s) $flag" >>"$OUT/train.log"
        timeout 240 mpiexec -n $n $PY -m mpidl train --device gpu --model $model --epochs 2 \
          --no-progress --out-dir "/tmp/mpidl-runs/$model-$n$flag" $flag >>"$OUT/train.log" 2>&1 \
          || say "train $spec failed: $(tail -2 "$OUT/train.log")"
      done
      $PY - "$OUT/train.log" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("=="):
        print(line.strip())
    elif line.startswith("{") and '"images_per_sec"' in line:
        r = json.loads(line)
        print(f"   epoch {r['epoch']}: test acc {r['test_acc']:.4f}, {r['images_per_sec']:,.0f} images/s")
    elif "cuda-graph" in line or "error" in line.lower():
        print("  ", line.strip()[:200])
PYEOF
      ;;
    *) say "unknown step $step"; exit 2 ;;
  esac
done

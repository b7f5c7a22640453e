"""The CUDA sources compile with nvcc (where it is installed), and gpu.py only launches
kernels that exist in them. Running the kernels needs a device: tests/test_kernels.py
runs every test on CuPy arrays too where CuPy sees one."""

import glob
import os
import re
import shutil
import subprocess

import pytest

import mpidl.kernels as K

CUDA_DIR = os.path.join(os.path.dirname(K.__file__), "cuda")
SOURCES = sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu")))


def test_there_are_cuda_sources():
    assert {os.path.basename(p) for p in SOURCES} >= {"onebit.cu", "quantize.cu", "sparse.cu"}


@pytest.mark.parametrize("source", SOURCES, ids=os.path.basename)
def test_cuda_source_compiles(source, tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists(
        "/usr/local/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    out = tmp_path / "k.ptx"
    for arch in ("sm_90", "sm_80"):  # Hopper; older toolkits stop at Ampere
        proc = subprocess.run([nvcc, "--ptx", f"-arch={arch}", "-std=c++14", "-o", str(out),
                               source], capture_output=True, text=True, timeout=300)
        if proc.returncode == 0 or "Unsupported gpu architecture" not in proc.stderr:
            break
    assert proc.returncode == 0, f"nvcc failed on {source}:\n{proc.stderr}"
    ptx = out.read_text()
    for name in re.findall(r"__global__\s+void\s+(\w+)", open(source).read()):
        assert f".entry {name}(" in ptx, f"kernel {name} missing from the PTX (extern \"C\"?)"


def test_gpu_module_launches_existing_kernels():
    defined = {}
    for path in SOURCES:
        mod = os.path.splitext(os.path.basename(path))[0]
        defined[mod] = set(re.findall(r"__global__\s+void\s+(\w+)", open(path).read()))
    src = open(os.path.join(os.path.dirname(K.__file__), "gpu.py")).read()
    calls = re.findall(r'_launch\("(\w+)", "(\w+)"', src)
    calls += re.findall(r'_module\("(\w+)"\)\.get_function\("(\w+)"\)', src)
    assert calls
    for mod, name in calls:
        assert name in defined.get(mod, ()), f"gpu.py launches {mod}.{name}, not in cuda/{mod}.cu"


@pytest.mark.gpu
@pytest.mark.parametrize("source", SOURCES, ids=os.path.basename)
def test_cuda_source_compiles_with_nvrtc(source):
    """The compiler CuPy's RawModule uses (NVRTC, no device needed), for Hopper."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        pytest.skip("CuPy is not installed")
    prog = nvrtc.createProgram(open(source).read(), os.path.basename(source), [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_90"])
    except Exception as e:  # noqa: BLE001 - the log says why
        pytest.fail(f"NVRTC failed on {source}: {e}\n{nvrtc.getProgramLog(prog)}")

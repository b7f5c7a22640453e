"""mpidl as a package: what pyproject.toml installs, on the oldest and newest pip/setuptools.

The install tests build a wheel of the checkout and install it, then the checkout itself
in editable mode, into a fresh virtual environment with ``--no-index --no-build-isolation``
(as on an offline node), and train from another directory with the venv's own ``mpidl``
and ``mpiexec``. Their wheels come from a wheelhouse (``.ci/wheelhouse DIR`` fills one; the
folder is ``$MPIDL_WHEELHOUSE``, by default ``.ci/wheelhouse-cache``); without it they skip.
"""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpirun import fashion_available, run_command

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

import mpidl

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = Path(os.environ.get("MPIDL_WHEELHOUSE", ROOT / ".ci" / "wheelhouse-cache"))

# (pip, setuptools, wheel): the oldest and newest pairs mpidl's install is tested on;
# .ci/wheelhouse downloads exactly these. setuptools < 70.1 needs the 'wheel' package to
# build (the oldest pair gets one of its time); newer setuptools has its own bdist_wheel.
OLDEST = ("23.0.1", "68.0.0", "0.45.1")
NEWEST = ("25.3", "81.0.0", None)
RUNTIME = ["numpy", "mpi4py", "mpich", "numba", "tqdm"]


def pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_packages_listed_are_the_folders_on_disk():
    """The packages are listed in pyproject.toml (kernels/ must install as mpidl.kernels,
    which discovery cannot do): a new subpackage left out of the list fails here."""
    conf = pyproject()["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "mpidl").rglob("__init__.py")}
    on_disk |= {".".join(("mpidl",) + p.parent.relative_to(ROOT).parts)
                for p in (ROOT / "kernels").rglob("__init__.py")}
    assert sorted(conf["packages"]) == sorted(on_disk)
    assert conf["package-dir"] == {"mpidl.kernels": "kernels"}
    assert "kernels" not in conf["packages"]


def test_version_has_one_source():
    """pyproject.toml reads the version from mpidl.__version__; the metadata of an installed
    mpidl and ``mpidl --version`` say the same."""
    assert pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mpidl.__version__"}
    assert "version" not in pyproject()["project"]
    out = subprocess.run([sys.executable, "-m", "mpidl.cli.main", "--version"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == f"mpidl {mpidl.__version__}"
    try:
        installed = importlib.metadata.version("mpidl")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("mpidl is not installed here (only on PYTHONPATH)")
    assert installed == mpidl.__version__


def test_a_checkout_uses_its_own_kernels(tmp_path):
    """Imported from a checkout, mpidl.kernels is the checkout's kernels/ — whatever else is
    installed (another tree's editable install, a wheel) — and NumPy is not loaded by
    ``import mpidl``."""
    code = ("import sys, mpidl; assert 'numpy' not in sys.modules; "
            "import mpidl.kernels, mpidl.kernels.cpu; "
            "print(mpidl.__file__); print(mpidl.kernels.__file__); "
            "print(mpidl.kernels.cpu.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(ROOT / "mpidl" / "__init__.py"),
                                  str(ROOT / "kernels" / "__init__.py"),
                                  str(ROOT / "kernels" / "cpu.py")]


def test_an_install_without_kernels_fails_at_import_in_one_line(tmp_path):
    """A half-installed mpidl (no mpidl.kernels, no checkout beside it) stops at import
    with one line that says how to fix it, not later at the first compressed step."""
    shutil.copytree(ROOT / "mpidl", tmp_path / "site" / "mpidl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # -S: no site-packages, so no installed mpidl's kernels can be found either
    out = subprocess.run([sys.executable, "-S", "-c", "import mpidl"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")))
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if "mpidl: error:" in line]
    assert len(errors) == 1 and "no mpidl.kernels" in errors[0], out.stderr
    assert "pip install --force-reinstall" in errors[0]


# ---------------------------------------------------------------- installs into fresh venvs

def clean_env():
    """The environment for pip and the venv's commands: none of this session's PYTHONPATH,
    venv or pip configuration (find-links, extra indexes), so only the wheelhouse counts."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def sh(cmd, cwd=None, timeout=300):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd,
                         env=clean_env(), timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def fresh_venv(path, pair):
    """A venv with exactly this pip/setuptools/wheel and mpidl's runtime dependencies, all
    from the wheelhouse. pip comes from its own wheel file (no ensurepip, no network)."""
    pip, setuptools, wheel = pair
    sh([sys.executable, "-m", "venv", "--without-pip", path])
    python = path / "bin" / "python"
    pip_wheel = WHEELHOUSE / f"pip-{pip}-py3-none-any.whl"
    sh([python, pip_wheel / "pip", "install", "-q", "--no-index", "--find-links", WHEELHOUSE,
        f"pip=={pip}", f"setuptools=={setuptools}", f"wheel=={wheel}" if wheel else "wheel"]
       + RUNTIME)
    return python


def copy_checkout(dest):
    """The checkout's sources without its venvs, caches and outputs: builds write build/
    and *.egg-info beside pyproject.toml, which must not land in the real checkout."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "venv*", "runs", "results", "__pycache__", ".pytest_cache",
        ".numba_cache", "wheelhouse-cache", "build", "dist", "*.egg-info"))
    return dest


def check_installed(venv, rundir, kernels_dir, version):
    """From ``rundir`` (not the checkout): mpidl.kernels comes from ``kernels_dir``, no
    top-level ``kernels`` exists, ``mpidl info`` works, and 2 ranks train one epoch."""
    bin_ = venv / "bin"
    code = ("import importlib.util, importlib.metadata, mpidl, mpidl.kernels; "
            "print(mpidl.kernels.__file__); print(importlib.util.find_spec('kernels')); "
            "print(mpidl.__version__, importlib.metadata.version('mpidl'))")
    lines = sh([bin_ / "python", "-c", code], cwd=rundir).splitlines()
    assert Path(lines[0]).parent == kernels_dir, lines
    assert lines[1] == "None", f"a top-level 'kernels' is importable: {lines[1]}"
    assert lines[2] == f"{version} {version}"
    assert sh([bin_ / "mpidl", "--version"], cwd=rundir).strip() == f"mpidl {version}"

    out = sh([bin_ / "mpidl", "info", "--json"], cwd=rundir)
    info = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert info["ranks"] == 1 and "MPICH" in info["mpi_library"], info
    metrics = rundir / "metrics.jsonl"
    # PYTHONPATH="" keeps the test session's mpidl (and tests/) out of the ranks
    launch = run_command([bin_ / "mpiexec", "-n", "2", bin_ / "mpidl", "train", "--no-progress",
                          "--model", "mlp", "--epochs", "1", "--limit-train", "2000",
                          "--limit-test", "500", "--metrics", metrics, "--out-dir", rundir / "run"],
                         cwd=rundir, timeout=240, env={"PYTHONPATH": ""}).check()
    with open(metrics, encoding="utf-8") as f:
        rec = [json.loads(line) for line in f if line.strip()][-1]
    assert rec["ranks"] == 2 and rec["epoch"] == 1, launch.output
    assert rec["test_acc"] > 0.4, launch.output  # 10 classes: chance is 0.1


@pytest.mark.parametrize("pair", [
    pytest.param(OLDEST, id="pip23.0.1-setuptools68"),
    pytest.param(NEWEST, id="pip25.3-setuptools81", marks=pytest.mark.slow),
])
def test_wheel_and_editable_install_offline(pair, tmp_path):
    """Build a wheel once, install it with no index and no build isolation, train; then the
    same with an editable install of the checkout."""
    if not (WHEELHOUSE / f"pip-{pair[0]}-py3-none-any.whl").exists():
        pytest.skip(f"no wheelhouse at {WHEELHOUSE}: run .ci/wheelhouse {WHEELHOUSE} "
                    "(or set MPIDL_WHEELHOUSE)")
    if not fashion_available():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    venv = tmp_path / "venv"
    python = fresh_venv(venv, pair)
    src = copy_checkout(tmp_path / "src")
    rundir = tmp_path / "elsewhere"
    rundir.mkdir()

    build = [python, "-m", "pip", "wheel", "-q", "--no-index", "--no-build-isolation",
             "--no-deps", "--wheel-dir", tmp_path / "dist", src]
    if pair == OLDEST:  # setuptools < 70.1 without 'wheel': one line saying what to install
        sh([python, "-m", "pip", "uninstall", "-q", "-y", "wheel"])
        out = subprocess.run([str(c) for c in build], capture_output=True, text=True,
                             cwd=rundir, env=clean_env(), timeout=300)
        assert out.returncode != 0, out.stdout
        assert ("mpidl: error: building mpidl with this setuptools needs the 'wheel' package: "
                "pip install wheel") in out.stdout + out.stderr, out.stdout + out.stderr
        sh([python, "-m", "pip", "install", "-q", "--no-index", "--find-links", WHEELHOUSE,
            f"wheel=={pair[2]}"])
    sh(build, cwd=rundir)
    wheel, = (tmp_path / "dist").glob("mpidl-*.whl")
    assert re.fullmatch(rf"mpidl-{re.escape(mpidl.__version__)}-py3-none-any\.whl", wheel.name)
    sh([python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", wheel],
       cwd=rundir)
    site = Path(sh([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    assert (site / "mpidl" / "kernels" / "cuda" / "quantize.cu").is_file()  # package data
    assert not (site / "kernels").exists()
    check_installed(venv, rundir, site / "mpidl" / "kernels", mpidl.__version__)

    sh([python, "-m", "pip", "uninstall", "-q", "-y", "mpidl"], cwd=rundir)
    # Numba's on-disk cache (cache=True), where the run loaded Numba, wrote into the
    # installed package; pip leaves those files, and the folder they keep would shadow the
    # editable install as a namespace package. Nothing else may be left.
    left = [p for p in (site / "mpidl").rglob("*") if p.is_file()]
    assert all(p.suffix in (".nbi", ".nbc") for p in left), left
    shutil.rmtree(site / "mpidl", ignore_errors=True)
    sh([python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", "-e", src],
       cwd=rundir)
    check_installed(venv, rundir, src / "kernels", mpidl.__version__)

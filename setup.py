"""Build-time check only: mpidl's metadata, packages and extras are in pyproject.toml.

setuptools before 70.1 makes wheel metadata, wheels and editable installs with the
``wheel`` package. pyproject.toml asks for it, but ``pip install --no-build-isolation``
installs nothing, and setuptools would then stop with "invalid command 'bdist_wheel'";
this says instead what to install.
"""
import sys

from setuptools import setup

if {"dist_info", "bdist_wheel", "editable_wheel"} & set(sys.argv[1:]):
    try:
        import setuptools.command.bdist_wheel  # noqa: F401  (setuptools >= 70.1)
    except ImportError:
        try:
            import wheel.bdist_wheel  # noqa: F401
        except ImportError:
            sys.exit("mpidl: error: building mpidl with this setuptools needs the 'wheel' "
                     "package: pip install wheel (or setuptools>=70.1), then build again")

setup()

"""What differs between setuptools 68 and 81; the rest of mpidl's package is in pyproject.toml.

The licence (MIT, text in LICENSE): setuptools >= 77 writes it as an SPDX expression and
deprecates every older way to say it (a ``license`` table, a licence classifier), with a
date after which builds stop; setuptools before 77 knows only the older ``license`` field.

The ``wheel`` package: setuptools before 70.1 makes wheel metadata, wheels and editable
installs with it. pyproject.toml asks for it, but ``pip install --no-build-isolation``
installs nothing, and setuptools would then stop with "invalid command 'bdist_wheel'";
the check below says instead what to install.
"""
import sys

import setuptools
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

if int(setuptools.__version__.split(".")[0]) >= 77:
    setup(license_expression="MIT")
else:
    setup(license="MIT")

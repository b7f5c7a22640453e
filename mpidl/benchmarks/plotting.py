"""The plotting backend of the benchmarks' PNG figures."""

import sys


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (saying so on stderr)
    when matplotlib is not installed: a benchmark's JSON figures never depend on it."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    return plt

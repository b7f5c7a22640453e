"""``python -m mpidl ...`` runs the ``mpidl`` command (useful where the script is not on PATH)."""

from mpidl.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())

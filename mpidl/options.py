"""``Option``: one setting of ``mpidl train`` — a flag, a config-file key, a keyword.

It lives at the bottom of the package so that every part that has settings of its own
(the runtime's schedule, gradient syncs and presets; the core training settings in
``mpidl.config``) can declare them without importing anything above it. ``mpidl.config``
collects them; the command line turns each into a flag.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """One training setting: its name (the flag without dashes), type, default and help.

    ``check``: optional ``value -> None or "why it is wrong"`` for values the type and
    ``choices`` allow but the setting does not (``mpidl.config.validate`` runs it on the
    resolved value, so a bad value is one line before any training time is spent).
    """

    name: str
    type: type
    default: object
    help: str
    group: str = "training"
    choices: tuple = None
    metavar: str = None
    check: object = None

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

    ``same_as``: the name of another setting this one is an alias of, under the name its
    users know (``micro_batches`` is ``accumulate``); both set the other. ``shares`` and
    ``claims``: another setting's flag also sets this one, with the values
    ``claims(value)`` is true for (``--schedule 1f1b`` is the pipeline's schedule,
    ``--schedule cosine,1f1b`` sets both).
    """

    name: str
    type: type
    default: object
    help: str
    group: str = "training"
    choices: tuple = None
    metavar: str = None
    check: object = None
    same_as: str = None
    shares: str = None
    claims: object = None

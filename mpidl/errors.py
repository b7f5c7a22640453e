"""Errors that are the user's to fix, not the program's.

``UserError`` marks a mistake in what was asked for (a config key that does not exist, a
negative learning rate, a missing data directory, a corrupt data file, a model that does
not fit the data). The ``mpidl`` command prints its message as one line and exits with
status 2, without a traceback; every other exception is a bug and keeps its traceback.
Raise it (or a subclass) only where the cause is the input, and say what was wrong,
where, and what to do.
"""


class UserError(ValueError):
    """A problem with the user's input: printed as one line, exit status 2."""


class ConfigError(UserError):
    """A bad configuration value or key (command line or config file)."""


class DataError(UserError):
    """A dataset that is missing, unreadable or malformed."""


class AgreedUserError(UserError):
    """A user error that every rank raises together (the ranks agreed on it first).

    The command line then lets one rank print it once and every rank exit 2 on its own; a
    plain UserError raised by some ranks only ends all ranks through MPI_Abort instead.
    ``report``: whether this rank is the one that prints it (None: rank 0).
    """

    def __init__(self, message, report=None):
        super().__init__(message)
        self.report = report


class TrainingDiverged(AgreedUserError):
    """The training loss became NaN or infinite; every training rank sees the same
    (reduced) loss, so they stop together."""

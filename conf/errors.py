"""Errors that mean "the user's input is wrong", as opposed to a bug. The CLI prints them as
one line and exits non-zero; everything else keeps its traceback."""


class UserError(Exception):
    pass


class ConfigError(UserError, ValueError):
    """A config value that cannot work (checked beyond what the dataclass types enforce)."""


class RunFailure(Exception):
    """The run cannot go on, through no fault of its input (it diverged, say): the CLI prints one
    line and exits 1, with the run's checkpoints as they were."""

"""Errors that mean "the user's input is wrong", as opposed to a bug. The CLI prints them as
one line and exits non-zero; everything else keeps its traceback."""


class UserError(Exception):
    pass


class ConfigError(UserError, ValueError):
    """A config value that cannot work (checked beyond what the dataclass types enforce)."""

"""The single exception type of the data pipeline."""

from conf.errors import UserError


class DataError(UserError, ValueError):
    """Input data that cannot be turned into training samples.

    Raised for configuration and content problems (a missing path, an empty corpus, a malformed
    record, a corpus too short for one sample), never for bugs. The message is a single line that
    names the offending file, path, line or key, so it can be shown to the user as is.
    """

"""The one exception of the training scripts."""


class UsageError(Exception):
    """A problem the user can fix (bad flag, missing data, a model too big): printed as one line, no traceback."""

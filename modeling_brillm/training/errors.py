"""The one exception of the training scripts, and how a script reports it."""

import os
import sys


class UsageError(Exception):
    """A problem the user can fix (bad flag, missing data, a model too big): printed as one line, no traceback."""


def run_cli(parse_args, run, argv=None) -> int:
    """`run(parse_args(argv))`; a UsageError is one `error:` line on stderr (from the first process) and status 2."""
    args = parse_args(argv)
    try:
        return run(args)
    except UsageError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2

"""User-facing errors: one line, exit code 2, no traceback."""

from __future__ import annotations

import contextlib
import sys

USAGE_EXIT_CODE = 2


class UsageError(Exception):
    """A setting the user gave (or forgot) is wrong; the message says which and how to fix it."""

    def __init__(self, setting: str, problem: str, fix: str):
        super().__init__(f"{setting}: {problem} ({fix})")
        self.parts = (setting, problem, fix)


@contextlib.contextmanager
def exit_on_usage_error():
    """Turn a UsageError into the documented one-line error and exit code 2."""
    try:
        yield
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(USAGE_EXIT_CODE) from None

"""User-facing errors: one line, exit code 2, no traceback."""

from __future__ import annotations

import argparse
import contextlib
import sys

USAGE_EXIT_CODE = 2


class UsageError(Exception):
    """A setting the user gave (or forgot) is wrong; the message says which and how to fix it."""

    def __init__(self, setting: str, problem: str, fix: str):
        super().__init__(f"{setting}: {problem} ({fix})")
        self.parts = (setting, problem, fix)


class UserCodeError(UsageError):
    """A UsageError caused by an exception in the user's own code (a model or dataset factory): its
    traceback is printed before the one line, since that is where the user must look."""

    def __init__(self, setting: str, problem: str, fix: str, user_traceback: str):
        super().__init__(setting, problem, fix)
        self.user_traceback = user_traceback


class EchoedUsageError(UsageError):
    """Rank 0's UsageError, raised on the other ranks too so they all stop; rank 0 prints it, they do not."""


def first_line(err: BaseException, limit: int | None = 160) -> str:
    """An exception's first line for a one-line message (some, like EOFError, carry no text at all)."""
    lines = str(err).strip().splitlines()
    return (lines[0] if lines else type(err).__name__)[:limit]


def os_reason(err: OSError) -> str:
    """Why the OS refused, without the errno and the path (the message names the path itself)."""
    return err.strerror or first_line(err)


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own two-line usage error breaks the one-line contract
        setting, _, problem = message.partition(": ") if message.startswith("argument ") else ("", "", message)
        raise UsageError(setting.removeprefix("argument ").split("/")[-1] or "arguments", problem,
                         f"see `{self.prog} --help`")


def print_error(message: str) -> None:
    """`error: <message>` on stderr in one write: ranks that fail together share the stream, and
    unbuffered (PYTHONUNBUFFERED, as in the image) print() writes the newline separately."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def exit_on_usage_error(silent: bool = False):
    """Turn a UsageError into the documented one-line error and exit code 2. silent: exit 2 without the line (a
    process whose peer on the same host prints the very same one)."""
    try:
        yield
    except UsageError as err:
        if not isinstance(err, EchoedUsageError) and not silent:
            if isinstance(err, UserCodeError):
                sys.stderr.write(err.user_traceback)
            print_error(str(err))
        raise SystemExit(USAGE_EXIT_CODE) from None


class Diverged(Exception):
    """The weights hold NaN or inf: the run stops and does not commit them (one line, exit 1)."""


class Fenced(Exception):
    """This host came back (from a freeze, a long pause, a cut network) after the rest of the job went on without it:
    it writes no checkpoint and joins no collective of the newer group, and leaves (in-place recovery)."""

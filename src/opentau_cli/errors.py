"""Exceptions that the CLI turns into one clear line and an exit code."""


class UserError(Exception):
    """Bad usage, bad config or bad input: exit code 2, nothing written."""

    exit_code = 2


class RunError(Exception):
    """A failure while running (exit code 1); the message should name the full log."""

    exit_code = 1


class Stopped(BaseException):
    """A preemption signal (SIGTERM / SIGUSR1, its name the message) reached a command before it finished: raised by
    the console script's handler so that the command cleans up on its way out and says so in one line. A
    BaseException, so that no `except Exception` takes it for a failure."""

    exit_code = 143

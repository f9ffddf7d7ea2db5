"""Exceptions that the CLI turns into one clear line and an exit code."""


class UserError(Exception):
    """Bad usage, bad config or bad input: exit code 2, nothing written."""

    exit_code = 2


class RunError(Exception):
    """A failure while running (exit code 1); the message should name the full log."""

    exit_code = 1

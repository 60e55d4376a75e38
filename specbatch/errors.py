"""The error a user can fix: the CLI prints its message in one line and exits with 2."""


class UserError(Exception):
    """A problem with the user's input (a path, a file, a number, a model): one line, exit code 2."""

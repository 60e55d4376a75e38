"""specbatch's exceptions share one base, SpecbatchError; UserError is the one a user can fix: the
CLI prints its message in one line and exits with 2."""


class SpecbatchError(Exception):
    """The base of every exception specbatch raises on purpose (catch this to catch them all)."""


class UserError(SpecbatchError):
    """A problem with the user's input (a path, a file, a number, a model): one line, exit code 2."""

"""User-facing errors: printed as one line by the CLI, with a non-zero exit and no traceback."""


class UserError(Exception):
    """Bad input from the user; the message names the problem and the fix."""

"""User-facing errors: printed as one line by the CLI, with a non-zero exit and no traceback."""


class UserError(Exception):
    """Bad input from the user; the message names the problem and the fix."""
    exit_code = 2


class TrainingStopped(UserError):
    """Training cannot go on (train.on_nan=stop after a streak of bad steps); its own exit code."""
    exit_code = 3


class CheckpointUnreadable(UserError):
    """A checkpoint could not be restored for a reason that is not damage (memory, I/O, permissions);
    nothing was moved or skipped. Its own exit code: the same command may succeed once that is fixed."""
    exit_code = 4

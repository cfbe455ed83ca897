"""The one exception type for mistakes a user can fix from the command line."""


class UsageError(Exception):
    """Bad option or missing input: shown as a single `error: ...` line, exit status 2."""


class TrainingDiverged(Exception):
    """The input was valid but the loss left the finite numbers: one `error: ...` line, exit status 1."""

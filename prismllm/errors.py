"""The one exception type a user sees: a clear message, no traceback."""


class PrismError(Exception):
    """A problem with the user's input or program, reported as one clear message by the CLI."""

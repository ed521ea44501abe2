class CaptError(ValueError):
    """A user-facing error: says what was wrong and what is valid."""

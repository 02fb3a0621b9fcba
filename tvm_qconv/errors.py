"""User-facing errors: each message says what is wrong and what to do."""


class InputError(ValueError):
    """Bad user input; the message says what is wrong and what to do."""

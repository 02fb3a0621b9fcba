"""User-facing errors: each message says what is wrong and what to do."""


class InputError(ValueError):
    """Bad user input; the message says what is wrong and what to do."""


class UnverifiedLibraryWarning(UserWarning):
    """A library was loaded whose build failed (or could not judge) its verification against the
    float model: its outputs may be wrong."""

"""User-facing errors: each message says what is wrong and what to do."""


class InputError(ValueError):
    """Bad user input; the message says what is wrong and what to do."""


class UnverifiedLibraryWarning(UserWarning):
    """A library was loaded whose build failed (or could not judge) its verification against the
    float model: its outputs may be wrong."""


def message_line(err: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (its type's name when it has none), for an
    :class:`InputError` that says in one line what a library underneath refused."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:limit]

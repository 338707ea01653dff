"""User-facing errors: each message says what to change. The CLI prints them as one line."""


class SpecDecodeError(ValueError):
    """A request or configuration the engine cannot serve, with the fix in the message."""

    http_status = 400  # what the server answers (a subclass names a better code)


class ModelNotFoundError(SpecDecodeError):
    pass

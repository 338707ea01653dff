"""User-facing errors: each message says what to change. The CLI prints them as one line."""


class SpecDecodeError(ValueError):
    """A request or configuration the engine cannot serve, with the fix in the message."""


class ModelNotFoundError(SpecDecodeError):
    pass

"""Exceptions a user can act on. Each message is one line naming the problem."""


class LocalbatchError(Exception):
    """Base class: anything raised on purpose by localbatch."""


class GGUFError(LocalbatchError):
    """The model file cannot be used: not a GGUF, truncated, unsupported architecture or tensor type,
    missing tensor, shape mismatch."""


class RequestError(LocalbatchError, ValueError):
    """A request is invalid: bad parameter, empty prompt, prompt longer than the context, etc.
    `param` names the offending field when there is one (the HTTP layer reports it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(LocalbatchError):
    """The waiting queue is full (backpressure); retry later."""


class EngineDeadError(LocalbatchError):
    """The engine loop has stopped; no further requests are served."""

"""How a request to the server can fail: each error with its HTTP status (what a request
asks for, ``Sampling``, is ``meshyard.inference.sampling``'s)."""

from __future__ import annotations


class ServeError(Exception):
    """A request the server answers with ``status`` and a one-paragraph ``message``."""

    status = 500

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class BadRequest(ServeError):
    """The request itself is wrong (400 malformed, 413 too large, 422 invalid values)."""

    status = 422


class ReadTimeout(BadRequest):
    """The request's body did not arrive within serve.read_timeout_s (408); the connection is
    closed after the answer, as the rest of the body may still be on its way."""

    status = 408


class NotFound(ServeError):
    """No such model or version (404)."""

    status = 404


class QueueFull(ServeError):
    """The model's queue is full (503); ``retry_after_s`` goes into the Retry-After header."""

    status = 503

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(ServeError):
    """The request was not answered before its deadline (504)."""

    status = 504


class Unavailable(ServeError):
    """The model cannot be loaded or run right now (503), e.g. it does not fit the memory budget."""

    status = 503

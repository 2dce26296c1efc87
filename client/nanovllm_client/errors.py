"""Exceptions the client raises. Errors from the service arrive as data and become these."""
from __future__ import annotations


class NanovllmError(Exception):
    """Base class of every error this package raises."""


class RequestError(NanovllmError):
    """The service ended a request with an error (invalid input, engine refusal, ...)."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class EngineDeadError(RequestError):
    """The engine died (or is not up yet): in-flight requests failed, new ones are refused."""


class RequestTimeoutError(NanovllmError):
    """A request did not finish within its timeout; it was aborted in the engine."""


class ServiceUnavailableError(NanovllmError):
    """The service did not answer at all (no detokenizer reachable at the given address)."""


class ServiceDrainingError(ServiceUnavailableError):
    """The service is shutting down: requests in flight finish, new ones are refused at once."""

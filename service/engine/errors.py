"""Errors the engine raises for a bad request; transport maps each to a gRPC status."""


class RequestError(Exception):
    """A request the engine refuses; the message says what was expected."""


class ModelNotFound(RequestError):
    """The named model is not hosted here (NOT_FOUND)."""


class InvalidRequest(RequestError):
    """The request is malformed or out of the model's range (INVALID_ARGUMENT)."""


class TooLarge(RequestError):
    """The reply would exceed a size limit; the message says how to narrow it (RESOURCE_EXHAUSTED)."""

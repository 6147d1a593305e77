"""Errors the engine raises for a bad request; transport maps each to a gRPC status.
No torch here: a frontend worker maps them too (the checks that raise them: checks.py)."""


class RequestError(Exception):
    """A request the engine refuses; the message says what was expected."""


class ModelNotFound(RequestError):
    """The named model is not hosted here (NOT_FOUND)."""


class InvalidRequest(RequestError):
    """The request is malformed or out of the model's range (INVALID_ARGUMENT)."""


class Abandoned(RequestError):
    """The caller cancelled before its session step was kept: the step was rolled back
    (CANCELLED; the caller is no longer there to hear it)."""


class DeadlinePassed(Abandoned):
    """The caller's deadline passed before its session step was kept: rolled back
    (DEADLINE_EXCEEDED)."""


class TooLarge(RequestError):
    """The reply would exceed a size limit; the message says how to narrow it (RESOURCE_EXHAUSTED)."""

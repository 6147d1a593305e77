"""Errors the engine raises for a bad request; transport maps each to a gRPC status."""

import torch


class RequestError(Exception):
    """A request the engine refuses; the message says what was expected."""


class ModelNotFound(RequestError):
    """The named model is not hosted here (NOT_FOUND)."""


class InvalidRequest(RequestError):
    """The request is malformed or out of the model's range (INVALID_ARGUMENT)."""


class TooLarge(RequestError):
    """The reply would exceed a size limit; the message says how to narrow it (RESOURCE_EXHAUSTED)."""


def require_finite(t: torch.Tensor, what: str) -> torch.Tensor:
    """Finite inputs can still overflow (|x| ~ 1e20 in float32, or > 65504 in float16)."""
    if not bool(torch.isfinite(t).all()):
        raise InvalidRequest(
            f"the {what} overflowed to NaN/Inf in {str(t.dtype).removeprefix('torch.')}: the input "
            "values are too large for the model's dtype or the requested dtype; scale the input "
            "down or ask for a wider dtype (float32)"
        )
    return t

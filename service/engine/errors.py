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


# An IEEE float is NaN or Inf exactly when all its exponent bits are set.
_EXPONENT_BITS = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
}


def all_finite(t: torch.Tensor) -> bool:
    """Whether a CPU tensor holds no NaN/Inf, checked with numpy on its bits.

    Not torch.isfinite: a torch op on another thread (the event loop) would start a second
    OpenMP thread pool, and two pools spinning on 2 cores slow every forward pass.
    """
    if t.device.type != "cpu" or t.dtype not in _EXPONENT_BITS:
        return bool(torch.isfinite(t).all())
    int_dtype, mask = _EXPONENT_BITS[t.dtype]
    bits = t.contiguous().view(int_dtype).numpy()
    return not bool(((bits & mask) == mask).any())


def require_finite(t: torch.Tensor, what: str) -> torch.Tensor:
    """Finite inputs can still overflow (|x| ~ 1e20 in float32, or > 65504 in float16)."""
    if not all_finite(t):
        raise InvalidRequest(
            f"the {what} overflowed to NaN/Inf in {str(t.dtype).removeprefix('torch.')}: the input "
            "values are too large for the model's dtype or the requested dtype; scale the input "
            "down or ask for a wider dtype (float32)"
        )
    return t

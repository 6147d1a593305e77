"""The engine's numeric checks of tensors on the CPU: finiteness, max |x|, and the errors for
values that overflow (engine/errors.py holds the error classes, without torch)."""

import math

import numpy as np
import torch

from mha_serve.engine.errors import InvalidRequest

_MAX, _MIN = np.maximum.reduce, np.minimum.reduce
# array_absmax reads an input of at most this many values (a decode step's token, a small
# request) with torch, far below the size at which torch splits an op across threads
# (32768): no OpenMP team starts on the caller's thread (the event loop's).
SMALL_INPUT_VALUES = 4096
# numpy has no bfloat16: its NaN and Inf are the values whose 8 exponent bits are all set.
_BF16_EXPONENT = 0x7F80


def all_finite(t: torch.Tensor) -> bool:
    """Whether a CPU tensor holds no NaN/Inf, checked with numpy.

    Not torch.isfinite: a torch op on another thread (the event loop) would start a second
    OpenMP thread pool, and two pools on 2 cores slow every forward pass.
    """
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return bool(torch.isfinite(t).all())
    if t.dtype == torch.bfloat16:
        bits = t.detach().contiguous().view(torch.int16).numpy()
        return not bool(((bits & _BF16_EXPONENT) == _BF16_EXPONENT).any())
    return bool(np.isfinite(t.detach().numpy()).all())


def absmax(t: torch.Tensor) -> float:
    """max |x| of a CPU tensor as a float, with numpy (as all_finite, never a torch op on the
    caller's thread); NaN or inf when it holds one. One pass for the finiteness check that
    also bounds everything computed from it (mha_serve.model.overflow)."""
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return float(t.detach().abs().max())
    if t.dtype == torch.bfloat16:  # the largest magnitude is the largest sign-less bit pattern;
        bits = t.detach().contiguous().view(torch.int16).numpy()  # NaN and inf lie above all
        top = int((bits & 0x7FFF).max())  # finite ones (exponent bits all set)
        if top >= _BF16_EXPONENT:
            return math.nan if top > _BF16_EXPONENT else math.inf
        return float(np.array([top << 16], dtype=np.uint32).view(np.float32)[0])
    a = t.detach().numpy()
    # The ufuncs' own reduce, not ndarray.max(): a Python wrapper less per call (a decode
    # step's 512 values took 9 us that way, 3 us this). Both propagate NaN.
    return float(max(_MAX(a, axis=None), -_MIN(a, axis=None)))


def array_absmax(a, t: torch.Tensor | None = None) -> float:
    """absmax of an engine Array (engine/requests.py: numpy memory, bfloat16 as its bits),
    the request's one scan; NaN or inf when it holds one. t: the same memory as a CPU tensor
    (tensor_of), when the caller has it.

    An input of at most SMALL_INPUT_VALUES is read on t with one torch.aminmax (NaN goes to
    both ends, as torch documents it): served, a step's torch ops then find torch's code
    warm, where numpy's ufunc machinery is entered cold for the scan alone
    (bench/step_layers.py, gqa at 256, 8 rounds against two numpy reductions: door.attend
    429 against 453 us). Larger ones are read on the numpy memory."""
    data = a.data
    if t is not None and data.size <= SMALL_INPUT_VALUES:
        lo, hi = torch.aminmax(t)
        top, bottom = hi.item(), -lo.item()
        if top != top or bottom != bottom:  # (NaN)
            return math.nan
        return top if top >= bottom else bottom
    if a.dtype == "bfloat16":
        top = int(_MAX(data & 0x7FFF, axis=None))
        if top >= _BF16_EXPONENT:
            return math.nan if top > _BF16_EXPONENT else math.inf
        return float(np.array([top << 16], dtype=np.uint32).view(np.float32)[0])
    return float(max(_MAX(data, axis=None), -_MIN(data, axis=None)))  # both propagate NaN


def require_finite(t: torch.Tensor, what: str) -> torch.Tensor:
    """Finite inputs can still overflow (|x| ~ 1e20 in float32, or > 65504 in float16)."""
    if not all_finite(t):
        raise InvalidRequest(
            f"the {what} overflowed to NaN/Inf in {str(t.dtype).removeprefix('torch.')}: the input "
            "values are too large for the model's dtype or the requested dtype; scale the input "
            "down or ask for a wider dtype (float32)"
        )
    return t


def scores_overflow_error(dtype: torch.dtype) -> InvalidRequest:
    """A request whose attention scores (q . k) or values would overflow the compute dtype:
    refused whatever a kernel would make of them (mha_serve.model.overflow)."""
    name = str(dtype).removeprefix("torch.")
    return InvalidRequest(
        f"the attention scores of this input may overflow {name} (for a query and a key it "
        "attends to, sum_i |q_i| |k_i|, the bound on q . k that every machine computes alike, "
        f"reaches half of {torch.finfo(dtype).max:.3g} over the model's score factor; or its "
        "values are not finite): the input values are too large for the model; scale the "
        "input down"
    )

"""Engine calls for tests, in torch terms: requests built from tensors, outcomes read back as
tensors (the engine's own edge speaks Arrays: engine/requests.py).

    run(engine, hosted, req("mha", x, session_id=sid)).output  # a torch.Tensor
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mha_serve.cache import SessionStats
from mha_serve.engine import (
    UNATTENDED,
    Array,
    AttendOutcome,
    AttendRequest,
    Engine,
    HostedModel,
)
from mha_serve.engine.types import DTYPE_NAME, array_of, tensor_of


def _name(dtype: torch.dtype | str | None) -> str | None:
    return DTYPE_NAME[dtype] if isinstance(dtype, torch.dtype) else dtype


def _tuple(values: Sequence | None) -> tuple | None:
    return None if values is None else tuple(values)


def req(model: str, inputs: torch.Tensor, **kw: Any) -> AttendRequest:
    """An AttendRequest from a (B, L, E) tensor; lists may stand for tuples and torch dtypes
    for their names, as the old AttendCall took them."""
    for key in ("lengths", "weight_heads", "head_mask"):
        if key in kw:
            kw[key] = _tuple(kw[key])
    for key in ("weights_dtype", "output_dtype"):
        if key in kw:
            kw[key] = _name(kw[key])
    if inputs.dtype not in DTYPE_NAME:  # not a wire dtype: what prepare() must refuse
        name = str(inputs.dtype).removeprefix("torch.")
        return AttendRequest(model, Array(inputs.numpy(), name), **kw)
    return AttendRequest(model, array_of(inputs), **kw)


@dataclass
class State:
    """A CallState a test can change (what serving's Ticket is)."""

    deadline: float | None = None
    cancelled: bool = False
    claimed: bool = False


@dataclass
class Result:
    """An AttendOutcome with tensors."""

    output: torch.Tensor
    weights: torch.Tensor | None
    weight_heads: list[int]
    weight_query_start: int
    compute_ms: float
    batch_size: int
    session: SessionStats | None


def torched(outcome: AttendOutcome | Exception) -> Result | Exception:
    if isinstance(outcome, Exception):
        return outcome
    return Result(
        tensor_of(outcome.output),
        None if outcome.weights is None else tensor_of(outcome.weights),
        list(outcome.weight_heads),
        outcome.weight_query_start,
        outcome.compute_ms,
        outcome.batch_size,
        outcome.session,
    )


def attend(engine: Engine, request: AttendRequest, state: Any = UNATTENDED) -> Result:
    """Engine.attend: prepare, then compute; raises the request's error."""
    return torched(engine.attend(request, state))


def run(engine: Engine, hosted: HostedModel, request: AttendRequest, state: Any = UNATTENDED):
    """One request computed alone (prepared first); raises its error."""
    assert request.model == hosted.spec.name, "the request names another model"
    return torched(engine.run(engine.prepare(request, state)))


def run_batch(
    engine: Engine,
    hosted: HostedModel,
    requests: list[AttendRequest],
    states: list[Any] | None = None,
) -> list[Result | Exception]:
    """Requests prepared one by one, then computed as one batch (Engine.run_batch)."""
    states = states or [UNATTENDED] * len(requests)
    batch = [engine.prepare(r, s) for r, s in zip(requests, states, strict=True)]
    return [torched(o) for o in engine.run_batch(hosted, batch)]

"""A lone session step (Sessions._run_alone: a step that finds its lane idle, without weights
or a head mask): the batch's ops and checks without the batch's lists and sets.
Part of Sessions (sessions.py), kept in a file of its own."""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from mha_serve.cache import CacheError, Reservation
from mha_serve.engine.bounds import KeyBound, cleared, key_absmax
from mha_serve.engine.project import project_and_append
from mha_serve.engine.prompts import attend_prompts, prompt_rows
from mha_serve.engine.requests import AttendOutcome, AttendRequest, CallState
from mha_serve.engine.settle import raise_if_abandoned, step_outputs
from mha_serve.engine.types import HostedModel, Prepared, array_of, on_host, output_dtype
from mha_serve.model import AttentionOutput
from mha_serve.transfer import to_device

log = logging.getLogger(__name__)

# torch.inference_mode()'s own guard (torch/autograd/grad_mode.py enters it, behind three
# Python calls of its own): a lone step enters it directly, as torch.inference_mode() where
# a torch lacks it.
_INFERENCE_MODE = getattr(torch._C, "_InferenceMode", None)


class LoneStep:
    """Sessions' lone step (mixed into it; its state is Sessions': table, cache())."""

    def _run_alone(
        self, hosted: HostedModel, p: Prepared
    ) -> AttendOutcome | Exception | Reservation | None:
        """A lone step (one that finds its lane idle: most decode steps) without weights or a
        head mask whose bounds prove that nothing of it can overflow, run_steps' answer for
        it without the batch's lists and sets: the same ops on the same tensors, the same
        checks and outcome (tests/engine/test_lone_step.py). For a step with weights or a
        head mask, None, with nothing reserved; for one whose bounds cannot clear it, its
        reservation, still open: run_steps then runs either as a batch of one (the latter
        with that reservation, so that its room is never given back in between)."""
        request = p.request
        if request.need_weights or request.head_mask is not None:
            return None
        start = time.perf_counter()
        try:
            r = self.table.reserve(request.session_id, p.inputs.shape[1], claimed=p.state.claimed)
        except CacheError as e:
            return e
        return self._step_reserved(hosted, request, p.inputs, p.input_absmax, p.state, r, start)

    def decode_now(
        self,
        hosted: HostedModel,
        request: AttendRequest,
        x: torch.Tensor,
        input_absmax: float,
        state: CallState,
        max_keys: int | None,
    ) -> AttendOutcome | None:
        """Engine.decode_now's step: a plain one-token step of a session of hosted's model,
        its input x (1, 1, E) finite (input_absmax; converted to the model's dtype here),
        accepted and run as _run_alone runs it; None, nothing kept, when the batch's path is
        to take it instead (the static decode on, another model's session, more than
        max_keys keys (None: any), no room at once, bounds that cannot clear it): prepare and
        run_steps then take it, with their errors and waits. Its other errors are raised."""
        if self.decodes_fixed(hosted):
            return None
        start = time.perf_counter()
        table = self.table
        try:
            session = table.get(request.session_id)
            if session.model != hosted.spec.name or (
                max_keys is not None and session.num_tokens >= max_keys
            ):
                return None
            r = table.reserve(request.session_id, 1, claimed=state.claimed)
        except CacheError:
            return None
        outcome = self._step_reserved(hosted, request, x, input_absmax, state, r, start)
        if isinstance(outcome, Reservation):  # (its bounds cannot clear it)
            table.rollback(outcome)
            return None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _step_reserved(
        self,
        hosted: HostedModel,
        request: AttendRequest,
        inputs: torch.Tensor,
        input_absmax: float,
        state: CallState,
        r: Reservation,
        start: float,
    ) -> AttendOutcome | Exception | Reservation:
        """A lone step on its reservation r: its outcome, its error (nothing kept), or r
        itself, still open, when its bounds cannot clear it (see _run_alone)."""
        cache = self.cache(hosted.spec.name)
        kept = False  # until then (kept, or handed on), any error rolls the reservation back
        try:
            cached = key_absmax(r.engine_state)
            bound = cleared(hosted, cache.dtype, input_absmax, cached, 1.0)
            if bound is None:  # measured instead, as a batch of one, on this reservation
                kept = True
                return r
            x = to_device(inputs, hosted.device, hosted.dtype)  # (1, T, E)
            end = r.start + r.num_tokens
            with torch.inference_mode() if _INFERENCE_MODE is None else _INFERENCE_MODE(True):
                y = None
                module = hosted.module
                # A decode step of a plain config over a cache in its dtype: in one call
                if (
                    r.num_tokens == 1
                    and module.decodes_in_one
                    and cache.dtype == x.dtype
                    and not r.first_block
                ):
                    views = cache.step_views(r.block_table, r.slots[0], end)
                    if views is not None:  # (its blocks consecutive, as a session's usually are)
                        y = module.decode_one(x, *views)
                if y is None and prompt_rows(hosted, (r,), (r.num_tokens,)):  # an MLA prompt
                    q, _, _ = project_and_append(hosted, cache, x, (r,), expanded=True)
                    y = attend_prompts(module, cache, q, (r,), (r.num_tokens,)).output
                if y is None:
                    q, _, _ = project_and_append(hosted, cache, x, (r,))
                    keys, values = cache.read(
                        r.block_table, end, start=r.read_start, first_block=r.first_block
                    )
                    # (1, T, E): attend_cached's answer for one sequence, without its tuples
                    gate = module.output_gate(x)  # (1, T, gate_width); None: no gate
                    y = module.attend_step(q, keys, values, r.start, r.read_start, gate)
            compute_ms = (time.perf_counter() - start) * 1e3
            try:
                dtype = output_dtype(request)
                if y.dtype == dtype and y.is_cpu:  # the step's whole output
                    output = array_of(y)
                else:
                    host = on_host(y, [dtype])
                    out = AttentionOutput(y, None)
                    output, _ = step_outputs(out, host, None, dtype, 0, r, request, [], True)
                raise_if_abandoned(state)  # last, right before commit: the smallest gap
            except Exception as e:  # refused, or its caller gone: not kept
                return e
            kept = True  # (commit takes the reservation, even when it raises)
            try:
                stats = self.table.commit(r, engine_state=KeyBound(max(cached, bound)))
            except CacheError as e:  # closed while the step ran: its cache went with it
                return e
            except BaseException as e:  # a bug: rolled back, unless it was kept after all
                with contextlib.suppress(ValueError):
                    self.table.rollback(r)
                if not isinstance(e, Exception):
                    raise
                log.exception("settling a lone session step failed")
                return e
        finally:
            if not kept:
                self.table.rollback(r)
        return AttendOutcome(
            output=output, weights=None, compute_ms=compute_ms, batch_size=1, session=stats
        )

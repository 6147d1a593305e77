"""Computing prepared requests (Engine.run_batch): stateless requests of one batch key as
one padded forward, or one alone with its weights; session steps handed to Sessions; and
whether a request is small enough to run on the event loop's thread. Part of Engine
(engine.py), kept in a file of its own."""

from __future__ import annotations

import math
import time

import torch

from mha_serve.engine.bounds import cleared, gate_absmax
from mha_serve.engine.checks import array_absmax, require_finite, scores_overflow_error
from mha_serve.engine.errors import InvalidRequest
from mha_serve.engine.requests import UNATTENDED, AttendOutcome, AttendRequest, CallState
from mha_serve.engine.types import (
    DTYPES,
    HostedModel,
    Prepared,
    array_of,
    on_host,
    output_dtype,
    repeat_heads,
    tensor_of,
)
from mha_serve.model.overflow import weight_bounds

# A request this small runs on the event loop's thread when its lane is idle (Engine.
# runs_inline, batching/inline.py): at most this many tokens, attending (on the CPU) to at
# most INLINE_MAX_KV_BYTES of keys' K/V. Larger work keeps the compute thread and its torch
# threads.
INLINE_MAX_TOKENS = 16
INLINE_MAX_KV_BYTES = 4 << 20


class Computing:
    """Engine's compute (mixed into it; its state is Engine's: sessions, prepare)."""

    def attend(self, request: AttendRequest, state: CallState = UNATTENDED) -> AttendOutcome:
        """Prepares, then computes one request; raises RequestError subclasses for bad calls.
        A spilled session is brought back first."""
        if request.session_id:
            sid = request.session_id
            return self.live(sid, None, lambda: self.run(self.prepare(request, state)))
        return self.run(self.prepare(request, state))

    def run(self, p: Prepared) -> AttendOutcome:
        """The forward pass of one prepared request."""
        (outcome,) = self.run_batch(p.hosted, [p])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _run_one(self, p: Prepared) -> AttendOutcome:
        """A stateless request alone: its forward, its weights when asked."""
        hosted, call = p.hosted, p.request
        start = time.perf_counter()
        batch, seq_len, _ = call.inputs.shape
        x = p.inputs.to(hosted.device, hosted.dtype, non_blocking=True)
        lengths = None  # a list: the module checks it on the host (a device tensor would sync)
        if call.lengths is not None and any(n != seq_len for n in call.lengths):
            lengths = list(call.lengths)
        head_mask = None
        if call.head_mask is not None:
            head_mask = torch.tensor(call.head_mask, dtype=hosted.dtype, device=hosted.device)
        heads = call.heads(hosted.spec.attention.num_heads)
        query_end = call.query_end or seq_len
        with torch.inference_mode():
            out = hosted.module(
                x,
                lengths=lengths,
                causal=call.causal,
                need_weights=call.need_weights,
                weight_heads=sorted(set(heads)) if call.need_weights else None,
                query_range=(call.query_start, query_end) if call.need_weights else None,
                head_mask=head_mask,
                check_overflow=not _proven(hosted, [p]),
            )
            output = out.output.to(DTYPES[call.output_dtype or call.inputs.dtype])
            # Contiguous on the compute thread: encoding then runs no torch copy elsewhere.
            output = output.cpu().contiguous()
            weights = None
            if out.weights is not None:
                weights = repeat_heads(out.weights, heads).to(DTYPES[call.weights_dtype])
                weights = weights.cpu().contiguous()
            if out.overflow.rows():  # read with the output, never before the forward ends
                raise scores_overflow_error(hosted.dtype)
            require_finite(output, "output")
            if weights is not None:
                require_finite(weights, "attention weights")
        return AttendOutcome(
            output=array_of(output),
            weights=None if weights is None else array_of(weights),
            weight_heads=tuple(heads) if call.need_weights else (),
            weight_query_start=call.query_start if call.need_weights else 0,
            compute_ms=(time.perf_counter() - start) * 1e3,
            batch_size=batch,
        )

    def decode_now(
        self, request: AttendRequest, model: str, state: CallState
    ) -> AttendOutcome | None:
        """A plain decode step, prepared and run in one call on the caller's thread (serving
        calls it for a step that finds its lane idle, on the event loop's thread): one token
        of a session of `model`, without weights, head mask or lengths (in any dtype, its
        output in any: the lone step converts them as the lanes' does). The same checks,
        outcome and errors as run(prepare(request, state)) (tests/engine/test_decode_now.py),
        without the Prepared record, the batch's lists and the calls between: prepare's
        checks such a step can fail, then the lone step (Sessions.decode_now). None, nothing
        done or kept, for any other request, a step too large to run inline (runs_inline),
        or one that only the batch's path takes or refuses: prepare and the lanes then take
        it, with their errors."""
        hosted = self.models.get(model)
        if hosted is None:
            return None
        inputs = request.inputs
        output_dtype = request.output_dtype or inputs.dtype
        if (
            inputs.data.shape != hosted.one_token
            or request.need_weights
            or request.head_mask is not None
            or request.lengths is not None
            or request.causal is False
            or inputs.dtype not in DTYPES
            or output_dtype not in DTYPES
            or request.weights_dtype not in DTYPES
            or not self.output_fits(hosted.one_token[2] * DTYPES[output_dtype].itemsize)
        ):
            return None
        tensor = tensor_of(inputs)
        input_absmax = array_absmax(inputs, tensor)  # (prepare's one scan)
        if not input_absmax < math.inf:
            return None
        max_keys = INLINE_MAX_KV_BYTES // hosted.kv_bytes_per_key if hosted.on_cpu else None
        return self.sessions.decode_now(hosted, request, tensor, input_absmax, state, max_keys)

    @staticmethod
    def runs_inline(p: Prepared) -> bool:
        """Whether a prepared request is small enough to run on the event loop's thread,
        single-threaded, when its lane is idle: no weights, few tokens, a short context."""
        batch, seq_len, _ = p.inputs.shape
        if p.request.need_weights or batch * seq_len > INLINE_MAX_TOKENS:
            return False
        hosted = p.hosted
        if not hosted.on_cpu:
            # The kernels run on the device: the loop's thread only launches them and waits
            # for the output (tens of microseconds at any context), which costs less than
            # the two thread crossings it saves.
            return True
        return batch * p.num_keys * hosted.kv_bytes_per_key <= INLINE_MAX_KV_BYTES

    def run_batch(
        self, hosted: HostedModel, batch: list[Prepared]
    ) -> list[AttendOutcome | Exception]:
        """Prepared requests of one model with equal `key` as one padded forward (requests
        for weights come one at a time). Sequences are padded to the longest; the model
        masks padding, so each outcome equals the request run alone
        (tests/engine/test_batching.py). Calls of several keys are refused (ValueError): the
        first call's masking and head gates would be applied to every one."""
        if len(batch) > 1 and any(p.key != batch[0].key for p in batch):
            raise ValueError(
                "run_batch takes calls of one batch key (masking and head gates); got "
                f"{sorted({repr(p.key) for p in batch})}"
            )
        if batch[0].request.session_id is not None:
            return self.sessions.run_steps(hosted, batch, self._check_response_size)
        if len(batch) == 1:
            try:
                return [self._run_one(batch[0])]
            except InvalidRequest as e:
                return [e]
        assert not any(p.request.need_weights for p in batch), "weights calls run one by one"
        start = time.perf_counter()
        longest = max(p.inputs.shape[1] for p in batch)
        total = sum(p.inputs.shape[0] for p in batch)
        embed_dim = hosted.spec.attention.embed_dim
        # Uninitialised padding is fine: the model zeroes padded positions before projecting.
        x = torch.empty(total, longest, embed_dim, device=hosted.device, dtype=hosted.dtype)
        lengths: list[int] = []
        row = 0
        for p in batch:
            n, seq_len, _ = p.inputs.shape
            x[row : row + n, :seq_len].copy_(p.inputs, non_blocking=True)
            lengths += p.request.lengths if p.request.lengths is not None else [seq_len] * n
            row += n
        padded = any(n != longest for n in lengths)
        lengths_t = lengths if padded else None  # checked on the host by the module
        first = batch[0].request
        head_mask = None
        if first.head_mask is not None:
            head_mask = torch.tensor(first.head_mask, dtype=hosted.dtype, device=hosted.device)
        with torch.inference_mode():
            forward = hosted.module(
                x,
                lengths=lengths_t,
                causal=first.causal,
                head_mask=head_mask,
                check_overflow=not _proven(hosted, batch),
            )
            dtypes = [output_dtype(p.request) for p in batch]
            host = on_host(forward.output, dtypes)  # one copy for the batch
            outputs = []
            row = 0
            for p, dtype in zip(batch, dtypes, strict=True):
                n, seq_len, _ = p.inputs.shape
                out = host[row : row + n, :seq_len]
                outputs.append(out.to(dtype).contiguous())  # the copies we send
                row += n
            overflow = set(forward.overflow.rows())  # read with the outputs
        results: list[AttendOutcome | Exception] = []
        compute_ms = (time.perf_counter() - start) * 1e3
        row = 0
        for p, output in zip(batch, outputs, strict=True):
            n = p.inputs.shape[0]
            try:
                if overflow.intersection(range(row, row + n)):
                    raise scores_overflow_error(hosted.dtype)
                require_finite(output, "output")
                results.append(
                    AttendOutcome(array_of(output), None, compute_ms=compute_ms, batch_size=total)
                )
            except InvalidRequest as e:  # only this call's caller hears of it
                results.append(e)
            row += n
        return results


def _proven(hosted: HostedModel, batch: list[Prepared]) -> bool:
    """Whether every request's max |input| proves its forward cannot overflow (so the model
    takes no maxima to check it): engine/bounds.py."""
    gate = gate_absmax(batch[0].request.head_mask)
    wb = weight_bounds(hosted.module)  # once for the batch
    return all(
        cleared(hosted, hosted.dtype, p.input_absmax, 0.0, gate, wb) is not None for p in batch
    )

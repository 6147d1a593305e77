"""KV-cache sessions of the hosted models: the cache layer bound to the attention modules.

A step reserves cache slots, projects the whole batch's new tokens, writes their K/V, lets
each session attend over its own cached K/V (engine/attend.py: padded groups in one kernel
each, or one kernel per session over its blocks in place), projects the outputs as one
batch and commits; any failure rolls every reservation back, so a session never counts
tokens whose K/V were not written. Sessions here is the API; a batch's forward is in
forward.py, its settling in settle.py, a lone step's path in lone_step.py.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch

from mha_serve.cache import (
    CacheError,
    KVCache,
    Reservation,
    SessionSpilled,
    SessionStats,
    SessionTable,
)
from mha_serve.engine.attend import (
    FlashKernel,
    batched_by_default,
    flash_decode_unsupported,
    flash_varlen,
)
from mha_serve.engine.bounds import KeyBound, key_absmax
from mha_serve.engine.durable import Expectations, open_spill_tier, restore
from mha_serve.engine.errors import InvalidRequest, RequestError
from mha_serve.engine.forward import BatchForward, one_thread_is_enough
from mha_serve.engine.graphs import StaticDecode
from mha_serve.engine.lone_step import LoneStep
from mha_serve.engine.requests import AttendOutcome, AttendRequest
from mha_serve.engine.settle import Settling
from mha_serve.engine.types import DTYPES, HostedModel, Prepared

log = logging.getLogger(__name__)

# How plain decode steps run (Sessions' static_decode): as any step; in fixed shapes
# (engine/graphs.py); replayed from CUDA graphs of those shapes.
STATIC_DECODE_MODES = ("off", "eager", "graphs")


class Sessions(LoneStep, BatchForward, Settling):
    """The session table and one KV cache per model that has a cache budget: the one API
    through which the engine creates, steps, forks, truncates and closes sessions."""

    def __init__(
        self,
        models: dict[str, HostedModel],
        *,
        evict: bool,
        default_ttl_s: float | None,
        clock: Callable[[], float] = time.monotonic,
        id_prefix: str = "",
        max_sessions_per_client: int = 0,
        max_cache_bytes_per_client: int = 0,
        spill_dir: str = "",
        spill_bytes: int = 0,
        batched_attention: bool | None = None,
        static_decode: str = "off",
        flash_decode: bool = False,
    ) -> None:
        """id_prefix starts every session id (a Ray Serve replica's own id); the per-client
        limits bound each owner's live sessions and KV bytes (0: none); spill_dir: a full
        cache moves idle sessions there, up to spill_bytes ("": no spill tier);
        batched_attention: whether a batch of steps without weights attends in padded
        groups (engine/attend.py), None: by each model's device (batched_by_default);
        static_decode: how plain decode steps (one token each, no weights, no head mask)
        run: "off" as any step, "eager" in fixed shapes (engine/graphs.py, any device),
        "graphs" replayed from CUDA graphs of those shapes (models on CUDA; the others as
        "off"); flash_decode: batched plain decode steps of a model flash attention can run
        read each session's K/V in place, one kernel (engine/attend.py; the other models
        as without it, with a warning that says why)."""
        if static_decode not in STATIC_DECODE_MODES:
            raise ValueError(
                f"static_decode {static_decode!r} is not one of {', '.join(STATIC_DECODE_MODES)}"
            )
        self.static_decode = static_decode
        # Per model, made on its first plain decode batch (None: the model cannot run so),
        # with a lock: one step at a time uses its static buffers; a step that finds it
        # taken runs as any step.
        self._static: dict[str, tuple[StaticDecode, threading.Lock] | None] = {}
        self._static_made = threading.Lock()  # one StaticDecode (and graph pool) per model
        self.table = SessionTable(
            evict=evict, default_ttl_s=default_ttl_s, clock=clock, id_prefix=id_prefix
        )
        self.table.set_client_limits(
            max_sessions=max_sessions_per_client, max_bytes=max_cache_bytes_per_client
        )
        self.caches: dict[str, KVCache] = {}
        # Per model: steps without weights attend batched (a plain dict: tests flip it).
        self.batched_attention = {
            name: batched_by_default(hosted.device)
            if batched_attention is None
            else batched_attention
            for name, hosted in models.items()
        }
        # Per model with a cache: the kernel batched decode steps read their K/V in place
        # with (flash_decode; absent: gathered). A plain dict: tests put a reference in.
        self.flash_kernels: dict[str, FlashKernel] = {}
        for name, hosted in models.items():
            spec = hosted.spec
            if spec.kv_cache_bytes == 0:
                continue
            dtype = hosted.dtype if spec.kv_cache_dtype == "auto" else DTYPES[spec.kv_cache_dtype]
            if dtype != hosted.dtype and dtype.itemsize >= hosted.dtype.itemsize:
                raise ValueError(
                    f"model {name!r}: kv_cache_dtype {spec.kv_cache_dtype} is not narrower than "
                    f"the model's dtype {str(hosted.dtype).removeprefix('torch.')}: it would "
                    "hold K/V computed in the model's dtype in as many or more bytes, and round "
                    "them; use auto, or a narrower dtype"
                )
            try:
                cache = KVCache.from_config(
                    spec.attention,
                    budget_bytes=spec.kv_cache_bytes,
                    block_size=spec.kv_block_size,
                    dtype=dtype,
                    device=hosted.device,
                )
            except ValueError as e:
                raise ValueError(f"model {name!r}: kv_cache_bytes: {e}") from None
            self.caches[name] = cache
            if flash_decode:
                why = flash_decode_unsupported(spec.attention, hosted.device, hosted.dtype, dtype)
                if why is None:
                    self.flash_kernels[name] = flash_varlen
                else:
                    log.warning("flash_decode is on, but not for model %r: %s", name, why)
            window = spec.attention.sliding_window  # sessions then keep their window only
            self.table.add_model(name, cache, max_len=spec.max_seq_len, window=window)
        # What a session's record must match here: spill files, and sessions moved in.
        self.table.expected = Expectations(models, self.caches)
        self.table.engine_state_of = KeyBound.of  # K/V that arrive whole: bound recomputed
        if spill_dir and self.caches:
            self.table.set_spill(open_spill_tier(self.table.expected, spill_dir, spill_bytes))

    def cache(self, model: str) -> KVCache:
        cache = self.caches.get(model)
        if cache is None:
            raise InvalidRequest(
                f"model {model!r} serves no sessions (its kv_cache_bytes is 0); "
                f"models with sessions: {', '.join(self.caches) or 'none'}"
            )
        return cache

    def num_sessions(self, model: str) -> int:
        return self.table.num_sessions(model)

    def num_blocks_used(self, model: str) -> int:
        return self.table.pool(model).num_used

    def num_blocks_out_of_window(self, model: str) -> int:
        """Blocks freed so far because they fell out of a session's sliding window."""
        return self.table.num_blocks_out_of_window(model)

    @property
    def evicts(self) -> bool:
        """Whether a full cache evicts idle sessions (else it refuses new tokens)."""
        return self.table.evict

    def on_end(self, hook: Callable[[str], None]) -> None:
        """hook(reason) each time a session ends: "closed", "expired" or "evicted"."""
        self.table.on_end = hook

    def create(
        self, model: str, max_len: int | None, ttl_s: float | None, owner: str = ""
    ) -> SessionStats:
        self.cache(model)
        return self.table.made_stats(
            self.table.create(model, max_len=max_len, ttl_s=ttl_s, owner=owner)
        )

    def stats(self, session_id: str, owner: str | None = None) -> SessionStats:
        return self.table.session_stats(session_id, owner)

    def key_bound(self, session_id: str) -> float:
        """The live session's bound on max |k| and |v| of the K/V it holds (its KeyBound, 0.0
        while it holds none): what its next step's overflow check counts them as."""
        return key_absmax(self.table.get(session_id).engine_state)

    def model_of(self, session_id: str) -> str:
        """The model of a session, live or spilled (SessionNotFound says why there is none)."""
        try:
            return self.table.get(session_id).model
        except SessionSpilled:
            spilled = self.table.spilled(session_id)
            if spilled is None:  # brought back meanwhile
                return self.table.get(session_id).model
            return spilled.record.model

    def fork(self, session_id: str, ttl_s: float | None, owner: str | None = None) -> SessionStats:
        """A new session sharing the parent's tokens (copy-on-write); ttl_s None: the parent's."""
        return self.table.made_stats(self.table.fork(session_id, ttl_s=ttl_s, owner=owner))

    def close(self, session_id: str, owner: str | None = None) -> None:
        self.table.close(session_id, owner)

    def link_sequence(self, session_id: str, sequence_id: int | str | None) -> None:
        """The client's sequence the session steps (None: none), kept through spills and
        restarts (SessionTable.link_sequence)."""
        self.table.link_sequence(session_id, sequence_id)

    def sequence_links(self) -> list[tuple[str, str, str, int | str]]:
        """(session id, model, owner, sequence id) of every session that steps a sequence."""
        return self.table.sequence_links()

    # --- the spill tier (engine/durable.py) -------------------------------------------------

    def restore(self, session_id: str, owner: str | None = None) -> float:
        """Brings a spilled session back (reading its file); seconds taken, 0 if it was not
        spilled. NOT_FOUND for a caller not its owner, or a file that cannot be adopted."""
        return restore(self.table, session_id, owner)

    def spill_idle(self) -> list[str]:
        """Every idle session written to the spill tier (at shutdown); the ids written. Those
        left (a step of theirs still running when the grace period ended, or a write that
        failed) are lost with the process: a warning says how many."""
        if self.table.spill is None:
            return []
        written = self.table.spill_idle()
        if left := len(self.table):
            log.warning(
                "%d session(s) not written to the spill directory (a step of theirs was still "
                "running when the grace period ended, or its write failed): they are lost with "
                "this process",
                left,
            )
        return written

    def adopt_spilled(self) -> tuple[list[str], list[tuple[str, str]]]:
        """At start: the sessions the spill directory holds, taken over (adopted ids, refused
        (file, reason))."""
        return self.table.adopt_spilled()

    def close_spill(self) -> None:
        """Lets the spill directory go (its lock): after spill_idle, at exit."""
        if self.table.spill is not None:
            self.table.spill.close()

    def expire(self) -> list[str]:
        """Frees idle sessions past their TTL; returns their ids."""
        return self.table.expire()

    def claim(self, session_id: str, owner: str | None = None) -> None:
        """Claims the session for one step, from its receipt until its answer (release):
        another step meanwhile is refused with SessionBusy (SessionTable.claim)."""
        self.table.claim(session_id, owner)

    def release(self, session_id: str) -> None:
        """The claimed step is answered, or failed."""
        self.table.release(session_id)

    @contextlib.contextmanager
    def stepping(self, session_id: str, owner: str | None = None) -> Iterator[None]:
        """claim, and release when the block ends."""
        self.claim(session_id, owner)
        try:
            yield
        finally:
            self.release(session_id)

    def truncate(self, session_id: str, num_tokens: int, owner: str | None = None) -> SessionStats:
        """SessionTable.truncate: refused (SessionBusy) while a step of the session is
        unanswered, queued or computing."""
        return self.table.session_stats(self.table.truncate(session_id, num_tokens, owner).id)

    def validate_step(self, hosted: HostedModel, call: AttendRequest) -> int:
        """Session-specific checks, before the step queues (the table re-checks at reserve);
        the tokens the session holds."""
        session = self.table.get(call.session_id)
        if session.model != hosted.spec.name:
            raise InvalidRequest(
                f"session {call.session_id!r} belongs to model {session.model!r}, not "
                f"{hosted.spec.name!r}; leave model empty or name {session.model!r}"
            )
        batch, seq_len, _ = call.inputs.shape
        if batch != 1:
            raise InvalidRequest(
                f"a session step takes one sequence, (T, embed_dim) or (1, T, embed_dim); got batch {batch}"
            )
        if call.lengths is not None and tuple(call.lengths) != (seq_len,):
            raise InvalidRequest("a session step's tokens are all real: leave lengths empty")
        if call.causal is False:
            raise InvalidRequest(
                "session steps are causal (cached keys are exact only for causal attention); "
                "leave causal unset or true"
            )
        return session.num_tokens

    def run_steps(
        self,
        hosted: HostedModel,
        calls: list[Prepared],
        check_weights: Callable[[HostedModel, AttendRequest, int], None] | None = None,
    ) -> list[AttendOutcome | Exception]:
        """One batched forward for steps of different sessions of one model.

        Steps with weights arrive one at a time (their own lane); steps without share a batch.
        check_weights(hosted, call, num_keys) raises for weights over the limits: validation
        checked them against the session then, and a step of the same session kept since
        (queued ahead of this one) makes them larger.
        """
        start = time.perf_counter()
        handed: Reservation | None = None  # a lone step's, reserved by _run_alone
        if len(calls) == 1 and (calls[0].inputs.shape[1] != 1 or not self.decodes_fixed(hosted)):
            outcome = self._run_alone(hosted, calls[0])
            if isinstance(outcome, Reservation):  # bounds that cannot clear it: measured here
                handed = outcome
            elif outcome is not None:
                return [outcome]
        name = hosted.spec.name
        cache = self.cache(name)
        results: list[AttendOutcome | Exception | None] = [None] * len(calls)
        if handed is not None:  # (never given back meanwhile: nobody else takes its room)
            reserved: list[Reservation | CacheError] = [handed]
        else:
            reserved = self.table.reserve_many(
                [(p.request.session_id, p.inputs.shape[1], p.state.claimed) for p in calls]
            )
        # Until _settle takes them, any error rolls back the reservations still open.
        open_ = [r for r in reserved if isinstance(r, Reservation)]
        live: list[tuple[int, Reservation]] = []
        threads, small = 0, False
        try:
            for i, r in enumerate(reserved):
                if isinstance(r, CacheError):
                    results[i] = r
                    continue
                if calls[i].request.need_weights and check_weights is not None:
                    try:
                        check_weights(hosted, calls[i].request, r.start + r.num_tokens)
                    except RequestError as e:
                        open_ = [x for x in open_ if x is not r]
                        self.table.rollback(r)
                        results[i] = e
                        continue
                live.append((i, r))
            if not live:
                return results
            forward = None
            steps = [calls[i] for i, _ in live]
            static = self._static_for(hosted, cache, steps)
            if static is not None:  # plain decode steps in fixed shapes (engine/graphs.py)
                forward = self._forward_fixed(hosted, cache, steps, live, *static)
            if forward is None and len(live) > 1:
                small = one_thread_is_enough(cache, [r for _, r in live])
                threads = torch.get_num_threads()
                if small and threads > 1:
                    torch.set_num_threads(1)
            if forward is None:
                forward = self._forward(hosted, cache, steps, live)
        except BaseException:  # nothing was kept: every reservation still open goes back
            for r in open_:
                self.table.rollback(r)
            raise
        finally:
            if small and threads > 1:
                torch.set_num_threads(threads)
        compute_ms = (time.perf_counter() - start) * 1e3
        self._settle(forward, compute_ms, calls, live, results)
        return results

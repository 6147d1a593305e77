"""The session API of the engine, the one every front door calls (through Sessions alone):
create, fork, truncate and close sessions, the spill tier, moves between engines, claims.
Part of Engine (engine.py), kept in a file of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from mha_serve.cache import SessionSpilled, SessionStats, SpillInfo
from mha_serve.engine.errors import InvalidRequest
from mha_serve.engine.requests import CacheInfo
from mha_serve.engine.types import DTYPE_NAME

T = TypeVar("T")

# A call on a spilled session brings it back, then runs; spilled again before it ran (another
# session needed the room), it tries this many times in all.
RESTORE_TRIES = 3


class SessionAPI:
    """Engine's session calls (mixed into it; its state is Engine's: sessions, get)."""

    # --- sessions: the one API every front door calls (through Sessions alone) ----------

    def create_session(
        self,
        model: str,
        max_len: int | None = None,
        ttl_s: float | None = None,
        owner: str = "",
    ) -> SessionStats:
        """A new empty session of `model` (max_len None: the model's; ttl_s None: default);
        owner: the client whose per-client limits it counts against ("": none)."""
        if not model:
            raise InvalidRequest("model is empty; name one of the models ListModels returns")
        self.get(model)
        return self.sessions.create(model, max_len, ttl_s, owner)

    # Every call on a session takes `owner`, the caller's identity: a session made by an
    # identified client (cache.types.IDENTIFIED) answers it alone, NOT_FOUND to others as
    # for an id never made; None skips the check (the engine's own calls). A spilled session
    # is brought back first (live()).

    def get_session(
        self, session_id: str, owner: str | None = None, *, restore: bool = True
    ) -> SessionStats:
        sid = checked_session_id(session_id)
        return self.live(sid, owner, lambda: self.sessions.stats(sid, owner), restore)

    def session_model(self, session_id: str) -> str:
        """The model of a session, live or spilled (SessionNotFound says why there is none)."""
        return self.sessions.model_of(checked_session_id(session_id))

    def fork_session(
        self,
        session_id: str,
        ttl_s: float | None = None,
        owner: str | None = None,
        *,
        restore: bool = True,
    ) -> SessionStats:
        """A new session sharing the parent's tokens (copy-on-write); ttl_s None: the parent's."""
        sid = checked_session_id(session_id)
        return self.live(sid, owner, lambda: self.sessions.fork(sid, ttl_s, owner), restore)

    def truncate_session(
        self, session_id: str, num_tokens: int, owner: str | None = None, *, restore: bool = True
    ) -> SessionStats:
        sid = checked_session_id(session_id)
        truncate = self.sessions.truncate
        return self.live(sid, owner, lambda: truncate(sid, num_tokens, owner), restore)

    def close_session(self, session_id: str, owner: str | None = None) -> None:
        self.sessions.close(checked_session_id(session_id), owner)  # a spilled one's file just goes

    def live(
        self, session_id: str, owner: str | None, call: Callable[[], T], restore: bool = True
    ) -> T:
        """call(), bringing the session back from the spill tier first when it is there
        (restore_session: the file read here). restore False: SessionSpilled is raised
        instead, for AsyncEngine to bring it back off the event loop, waiting for room held
        by calls in flight (serving/retries.py)."""
        if not restore:
            return call()
        for _ in range(RESTORE_TRIES):
            try:
                return call()
            except SessionSpilled:  # (spilled again meanwhile, to make room: once more)
                self.restore_session(session_id, owner)
        return call()

    def is_spilled(self, session_id: str) -> bool:
        """Whether the session is in the spill tier (its next call brings it back)."""
        return bool(session_id) and self.sessions.table.spilled(session_id) is not None

    def restore_session(self, session_id: str, owner: str | None = None) -> float:
        """Brings a spilled session back; seconds it took (0: it was not spilled)."""
        return self.sessions.restore(checked_session_id(session_id), owner)

    def spill_idle(self) -> list[str]:
        """Every idle session written to the spill tier (at shutdown, once drained)."""
        return self.sessions.spill_idle()

    def adopt_spilled(self) -> tuple[list[str], list[tuple[str, str]]]:
        """At start: the sessions the spill directory holds, taken over (their ids, and the
        files refused with why)."""
        return self.sessions.adopt_spilled()

    def close_spill(self) -> None:
        self.sessions.close_spill()

    def link_sequence(self, session_id: str, sequence_id: int | str | None) -> None:
        """Names the client's sequence (a Triton sequence id) the session steps, None for
        none: it travels with the session's file, so that a restart can link it again."""
        self.sessions.link_sequence(session_id, sequence_id)

    def sequence_links(self) -> list[tuple[str, str, str, int | str]]:
        """(session id, model, owner, sequence id) of every session held, live or spilled,
        that steps a sequence (adopted at start: serving links them again)."""
        return self.sessions.sequence_links()

    def spill_info(self) -> SpillInfo:
        """The spill tier's sessions, bytes and budget; zeros without one."""
        return self.sessions.table.spill_info()

    @property
    def spills(self) -> bool:
        """Whether a spill tier is set (session_spill_dir)."""
        return self.sessions.table.spill is not None

    # --- moves: a session leaves this engine whole for another's (a Ray replica stopping) --

    def session_ids(self) -> list[str]:
        """Every session held, live or spilled, the least recently used first."""
        return self.sessions.table.session_ids()

    def pack_session(self, session_id: str) -> bytes:
        """The session as one record's bytes (a spill file's form) for receive_session on
        another engine with the same model; it stays here until session_moved. SessionBusy
        while a call holds it."""
        return self.sessions.table.pack(checked_session_id(session_id))

    def session_moved(self, session_id: str, where: str) -> None:
        """The session was received elsewhere: freed here; its later calls here are told
        NOT_FOUND saying it moved to `where`."""
        self.sessions.table.moved_out(checked_session_id(session_id), where)

    def receive_session(self, data: bytes, source: str = "a moved session") -> SessionStats:
        """Adopts a session packed by another engine, under its id, owner, limits and idle
        time: into the KV cache (making room as a step does), else the spill tier. BadRecord
        (not a session of a model served here, saying why), SessionExists, SessionNotFound
        (expired meanwhile), CacheExhausted / SpillFull (no room)."""
        return self.sessions.table.receive(data, source)

    def on_session_spill(self, hook: Callable[[str, int, str], None]) -> None:
        """hook(model, bytes, reason) each time a session is spilled ("room", "shutdown")."""
        self.sessions.table.on_spill = hook

    def expire_sessions(self) -> list[str]:
        """Frees idle sessions past their TTL (lookups also expire them lazily)."""
        return self.sessions.expire()

    def on_session_end(self, hook: Callable[[str], None]) -> None:
        """hook(reason) each time a session ends: "closed", "expired" or "evicted"."""
        self.sessions.on_end(hook)

    def claim(self, session_id: str, owner: str | None = None) -> None:
        """Claims a session for one step from its receipt to its answer (release it then:
        Sessions.claim); SessionSpilled when it is in the spill tier (restore_session it
        first). Plain calls, not a context manager: a few microseconds less on every step."""
        self.sessions.claim(checked_session_id(session_id), owner)

    def release(self, session_id: str) -> None:
        """The step claim() claimed is answered, or failed."""
        self.sessions.release(session_id)

    def stepping(self, session_id: str, owner: str | None = None):
        """claim, as a context manager (Sessions.stepping)."""
        return self.sessions.stepping(checked_session_id(session_id), owner)

    def cache_info(self, model: str) -> CacheInfo | None:
        """The model's KV cache, None when it serves no sessions."""
        cache = self.sessions.caches.get(model)
        if cache is None:
            return None
        return CacheInfo(
            budget_bytes=cache.budget_bytes,
            block_size=cache.block_size,
            bytes_per_token=cache.bytes_per_token,
            bytes_per_block=cache.bytes_per_block,
            num_blocks=cache.num_blocks,
            num_blocks_used=self.sessions.num_blocks_used(model),
            num_sessions=self.sessions.num_sessions(model),
            evict_idle_sessions=self.sessions.evicts,
            dtype=DTYPE_NAME[cache.dtype],
            num_blocks_out_of_window=self.sessions.num_blocks_out_of_window(model),
        )


def checked_session_id(session_id: str) -> str:
    if not session_id:
        raise InvalidRequest("session_id is empty; CreateSession returns one")
    return session_id

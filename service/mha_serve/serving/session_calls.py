"""AsyncEngine's calls on sessions other than their steps: Triton's sequences (the Open
Inference Protocol door), sessions made, read, forked, truncated and closed, and moves between
engines. Part of AsyncEngine (async_engine.py), kept in a file of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TypeVar

from mha_serve.cache import CacheError, SessionStats
from mha_serve.engine import RequestError
from mha_serve.serving.sequences import SequenceKey

T = TypeVar("T")


class SessionCalls:
    """AsyncEngine's session calls (mixed into it; its state is AsyncEngine's: engine,
    sequences, threads, _live, _abandoned)."""

    def _alive(self, session_id: str) -> bool:
        """Whether the session lives, here or spilled: never brought back (get_session
        would read a spilled one's file, on the event loop, and count it as used)."""
        try:
            self.engine.session_model(session_id)
        except (CacheError, RequestError):
            return False
        return True

    # --- Triton's sequences (the Open Inference Protocol door) -----------------------------
    # Each change is one call with no await inside: a caller cancelled between two round
    # trips (a frontend worker's) can never leave a session made and not mapped, or unmapped
    # and not closed.

    async def sequence_session(self, key: SequenceKey) -> str | None:
        return self.sequences.get(key)

    async def start_sequence(self, key: SequenceKey, model: str, owner: str) -> str:
        # A start for an id already active closes its old session first: a client at its
        # max_sessions_per_client can start its sequence again.
        previous = self.sequences.get(key)
        if previous is not None:
            self.sequences.end(key, previous)
            with contextlib.suppress(CacheError, RequestError):  # gone already: fine
                self.engine.close_session(previous)
        session_id = self.engine.create_session(model, None, None, owner).session_id
        self.engine.link_sequence(session_id, key[2])  # (written with it: a restart links it)
        self.sequences.start(key, session_id, live=self._alive)
        return session_id

    async def end_sequence(self, key: SequenceKey, session_id: str, *, close: bool) -> None:
        self.sequences.end(key, session_id)
        with contextlib.suppress(CacheError, RequestError):  # gone already: fine
            if close:
                self.engine.close_session(session_id)
            else:  # it lives on (a step in flight owns it), stepping no sequence
                self.engine.link_sequence(session_id, None)

    def link_adopted_sequences(self) -> None:
        """At start: the sequences of the sessions the engine adopted from its spill
        directory, linked again (a restart keeps a Triton sequence going)."""
        for session_id, model, owner, sequence_id in self.engine.sequence_links():
            self.sequences.start((model, owner, sequence_id), session_id, live=self._alive)

    # --- sessions ------------------------------------------------------------------------
    # Coroutines, so that a front door awaits them alike here and in a frontend worker,
    # where they are a round trip to the engine process (serving/remote.py).

    async def create_session(
        self, model: str, max_len: int | None, ttl_s: float | None, owner: str = ""
    ) -> SessionStats:
        return self.engine.create_session(model, max_len, ttl_s, owner)

    async def get_session(self, session_id: str, caller: str | None = None) -> SessionStats:
        get = self.engine.get_session
        return (
            await self._live(session_id, caller, lambda: get(session_id, caller, restore=False))
        )[0]

    async def fork_session(
        self, session_id: str, ttl_s: float | None, caller: str | None = None
    ) -> SessionStats:
        fork = self.engine.fork_session
        return (
            await self._live(
                session_id, caller, lambda: fork(session_id, ttl_s, caller, restore=False)
            )
        )[0]

    async def truncate_session(
        self, session_id: str, num_tokens: int, caller: str | None = None
    ) -> SessionStats:
        if self._abandoned and session_id in self._abandoned:
            # Its last step, cancelled (its caller gone or past its deadline), still
            # computes: the truncate waits for its rollback, as the next step would.
            await self._after_abandoned(session_id)
        truncate = self.engine.truncate_session
        live = await self._live(
            session_id, caller, lambda: truncate(session_id, num_tokens, caller, restore=False)
        )
        return live[0]

    async def close_session(self, session_id: str, caller: str | None = None) -> None:
        self.engine.close_session(session_id, caller)

    # --- moves (a Ray replica that Ray stops sends its sessions to another) -------------
    # On the compute thread: they read or write the KV cache (engine/threads.py).

    async def session_ids(self) -> list[str]:
        """Every session held here, live or spilled, the least recently used first."""
        return self.engine.session_ids()

    async def pack_session(self, session_id: str) -> bytes:
        """The session as one record's bytes; it stays here until session_moved."""
        return await self._on_compute(self.engine.pack_session, session_id)

    async def session_moved(self, session_id: str, where: str) -> None:
        """Received elsewhere: freed here, its later calls told where it went."""
        self.engine.session_moved(session_id, where)

    async def receive_session(self, data: bytes, source: str) -> SessionStats:
        """Adopts a session another engine packed, under its id (Engine.receive_session)."""
        return await self._on_compute(self.engine.receive_session, data, source)

    async def _on_compute(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.threads.main, fn, *args)

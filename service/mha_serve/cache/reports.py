"""What the session table reports: a session's stats, and per model its sessions, tokens,
blocks, bytes and fragmentation. Part of SessionTable (sessions.py), kept in a file of its
own; every method runs under the table's lock."""

from __future__ import annotations

from .types import ModelCache, ModelCacheStats, Session, SessionStats


class Reporting:
    """SessionTable's stats (mixed into it; its state is the table's)."""

    def made_stats(self, s: Session) -> SessionStats:
        """The stats of a session create() or fork() just returned, as made: without the
        lookup, whose TTL check would drop a session of a TTL shorter than the call took
        (the answer to its making says it exists; its next call finds it expired)."""
        with self._lock:
            return self._session_stats(s)

    def session_stats(self, session_id: str, owner: str | None = None) -> SessionStats:
        with self._lock:
            s = self._lookup(session_id, self._clock(), owner)
            self._check_owner(s, owner)
            return self._session_stats(s)

    def stats(self) -> dict[str, ModelCacheStats]:
        """Per model: tokens, blocks, bytes per session and in total, fragmentation."""
        with self._lock:
            return {name: self._model_stats(name, m) for name, m in self._models.items()}

    def _session_stats(self, s: Session, m: ModelCache | None = None) -> SessionStats:
        storage = (self._models[s.model] if m is None else m).storage
        num_blocks = len(s.block_table)
        return SessionStats(
            s.id,
            s.model,
            s.num_tokens,
            num_blocks,
            num_blocks * storage.bytes_per_block,
            s.max_len,
            s.ttl_s,
            s.first_block * storage.block_size,
        )

    def _model_stats(self, name: str, m: ModelCache) -> ModelCacheStats:
        bs, bpb, pool = m.storage.block_size, m.storage.bytes_per_block, m.pool
        live = [s for s in self._sessions.values() if s.model == name]
        filled: dict[int, int] = {}  # block id -> tokens it holds (forks share a prefix)
        for s in live + [z for z in self._zombies.values() if z.model == name]:
            for i, b in enumerate(s.block_table, start=s.first_block):
                held = min(bs, max(0, s.num_tokens - i * bs))
                filled[b] = max(filled.get(b, 0), held)
        stored = sum(filled.values())
        slots = pool.num_used * bs
        return ModelCacheStats(
            model=name,
            num_sessions=len(live),
            num_tokens=sum(s.num_tokens for s in live),
            num_tokens_stored=stored,
            num_blocks=pool.num_blocks,
            num_blocks_used=pool.num_used,
            num_blocks_free=pool.num_free,
            block_size=bs,
            bytes_per_block=bpb,
            budget_bytes=m.storage.budget_bytes,
            bytes_used=pool.num_used * bpb,
            fragmentation=(slots - stored) / slots if slots else 0.0,
            num_blocks_out_of_window=m.num_blocks_out_of_window,
            sessions=tuple(self._session_stats(s) for s in live),
        )

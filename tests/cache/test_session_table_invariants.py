"""Randomised invariants of SessionTable over a real KVCache (1 head, head_dim 1).

Operations: create, append (reserve+write+commit), reserve with the step left in flight,
commit/rollback of a step in flight, fork, truncate, close (also while a step is in
flight: zombie), pin/unpin, clock advance (TTL expiry), expire(), reserve_many batches.

Checked after every operation:
- every block's refcount == references to it from live sessions' and zombies' block tables;
- pool.num_used == distinct referenced blocks; the free extents are exactly the
  unreferenced blocks, sorted, disjoint and merged;
- a live session without a step in flight holds exactly cdiv(num_tokens, bs) blocks (with a
  sliding window: from the first block its next step can see, the others freed), and its
  K/V (KVCache.read) equal what was written for it (forks: the parent's prefix); a
  truncate is refused exactly when its next step would need a freed block;
- a session that vanished was expired (TTL passed, unpinned) or evicted (unpinned, only
  during a reserve, with eviction on); eviction evicts only what is needed: the victims
  make the step fit and no single one of them could have been spared; a reserve refused
  with CacheExhausted evicts nothing, and then not even every idle session would do.
At teardown every session is closed and every step settled: the pool is empty again.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mha_serve.cache import (
    CacheError,
    CacheExhausted,
    InvalidSessionArgument,
    KVCache,
    SessionBusy,
    SessionFull,
    SessionNotFound,
    SessionTable,
)
from mha_serve.cache.window import first_needed_block, shortest_truncate

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cdiv(a, b):
    return -(-a // b)


class TableMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 12),
        evict=st.booleans(),
        ttl=st.sampled_from([None, 5.0]),
        max_len=st.sampled_from([None, 40]),
        window=st.sampled_from([None, None, 3, 6]),
    )
    def setup(self, num_blocks, evict, ttl, max_len, window):
        self.bs = BS
        self.kv = KVCache(
            num_kv_heads=1, head_dim=1, budget_bytes=num_blocks * BS * 8, block_size=BS
        )
        assert self.kv.num_blocks == num_blocks
        self.kv.k.fill_(float("nan"))
        self.kv.v.fill_(float("nan"))
        self.clock = Clock()
        self.table = SessionTable(evict=evict, default_ttl_s=ttl, clock=self.clock)
        self.window = window
        self.table.add_model("m", self.kv, max_len=max_len, window=window)
        self.pool = self.table.pool("m")
        self.expected: dict[str, list[float]] = {}  # live session -> token labels
        self.pending: dict[str, tuple] = {}  # session -> (reservation, labels)
        self.zombie_pending: dict[str, tuple] = {}  # closed while a step was in flight
        self.pins: dict[str, int] = {}  # explicit pins (pin/unpin rule)
        self.label = 0.0

    # --- helpers ----------------------------------------------------------------------

    def _labels(self, n):
        out = [self.label + i + 1 for i in range(n)]
        self.label += n
        return out

    def _write(self, res, labels):
        t = torch.tensor(labels, dtype=torch.float32).view(1, 1, len(labels), 1)
        self.kv.append(t, -t, [list(res.slots)])

    def _snapshot(self):
        t = self.table
        return {
            "sessions": {
                sid: (list(s.block_table), s.in_use, s.last_used_s, s.ttl_s)
                for sid, s in t._sessions.items()
            },
            "zombies": {sid: list(s.block_table) for sid, s in t._zombies.items()},
            "refcounts": [self.pool.refcount(b) for b in range(self.pool.num_blocks)],
            "num_free": self.pool.num_free,
        }

    def _sync_gone(self, before, during_reserve, requester=None, needs=None, raised=None):
        """Sessions that vanished: check why, and the eviction choice."""
        live = set(self.table._sessions)
        gone = [sid for sid in self.expected if sid not in live]
        expired, evicted = [], []
        for sid in gone:
            with_reason = self.table._gone.get(sid)
            assert with_reason is not None, f"{sid} vanished without a reason"
            reason = with_reason[0]
            blocks, in_use, last_used, ttl = before["sessions"][sid]
            assert in_use == 0, f"pinned session {sid} went: {reason}"
            if reason == "expired":
                assert ttl is not None and self.clock.now - last_used > ttl
                expired.append(sid)
            elif reason == "evicted":
                assert during_reserve and self.table.evict, "evicted outside a reserve"
                evicted.append(sid)
            else:
                raise AssertionError(f"{sid} went with reason {reason}")
            del self.expected[sid]
            self.pins.pop(sid, None)
        if evicted:
            event(f"evicted {min(len(evicted), 3)}")
        if expired:
            event("expired")
        if isinstance(raised, CacheExhausted):
            event("exhausted")
        if needs is not None and needs[1] is not None:
            event("reserve with a shared partial last block")
        if needs is not None and (evicted or isinstance(raised, CacheExhausted)):
            self._check_victims(before, requester, needs, expired, evicted, raised)
        return gone

    def _check_victims(self, before, requester, needs, expired, evicted, raised):
        new_blocks, shared_last = needs
        refs = list(before["refcounts"])
        free = before["num_free"]
        for sid in expired:
            for b in before["sessions"][sid][0]:
                refs[b] -= 1
                free += refs[b] == 0

        def fits(victims):
            r = list(refs)
            f = free
            for sid in victims:
                for b in before["sessions"][sid][0]:
                    r[b] -= 1
                    f += r[b] == 0
            copy = shared_last is not None and r[shared_last] > 1
            return new_blocks + copy <= f

        if evicted:
            assert raised is None, f"evicted {evicted} and still raised {raised!r}"
            assert fits(evicted), "the victims do not make room"
            for v in evicted:
                rest = [x for x in evicted if x != v]
                assert not fits(rest), f"victim {v} was not needed"
        else:
            idle = [
                sid
                for sid, (_, in_use, _, _) in before["sessions"].items()
                if sid not in expired and in_use == 0 and sid != requester
            ]
            if self.table.evict:
                assert not fits(idle), "CacheExhausted although evicting idle sessions fits"

    def _needs(self, sid, n):
        s = self.table._sessions[sid]
        total = s.num_tokens + n
        new_blocks = cdiv(total, self.bs) - s.first_block - len(s.block_table)
        shared = (
            s.block_table[-1]
            if s.num_tokens % self.bs
            and s.block_table
            and self.pool.refcount(s.block_table[-1]) > 1
            else None
        )
        return new_blocks, shared

    def _reserve(self, sid, n):
        """reserve() with the eviction checks; returns (res, labels) or None."""
        before = self._snapshot()
        needs = self._needs(sid, n) if sid in self.table._sessions else None
        raised = None
        try:
            res = self.table.reserve(sid, n)
        except CacheError as e:
            raised = e
            res = None
        self._sync_gone(before, True, sid, needs, raised)
        if res is None:
            assert isinstance(raised, (CacheExhausted, SessionFull, SessionBusy, SessionNotFound))
            if isinstance(raised, CacheExhausted):
                assert self._snapshot()["sessions"].keys() == {
                    k for k in before["sessions"] if k in self.expected
                }
            return None
        labels = self._labels(n)
        self._write(res, labels)
        return res, labels

    def _live(self):
        return list(self.expected)  # insertion order: ids are random

    # --- rules ------------------------------------------------------------------------

    @rule(ttl=st.sampled_from([None, 2.0, 50.0]))
    def create(self, ttl):
        s = self.table.create("m", ttl_s=ttl)
        self.expected[s.id] = []

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        sid = data.draw(st.sampled_from(self._live()))
        if sid in self.pending:
            with_busy = self.table._sessions[sid].pending is not None
            assert with_busy
        got = self._reserve(sid, n)
        if got is None:
            return
        res, labels = got
        self.table.commit(res)
        self.expected[sid] += labels

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), n=st.integers(1, 6))
    def start_step(self, data, n):
        sid = data.draw(st.sampled_from(self._live()))
        got = self._reserve(sid, n)
        if got is not None:
            self.pending[sid] = got

    @precondition(lambda self: self.pending or self.zombie_pending)
    @rule(data=st.data(), keep=st.booleans())
    def finish_step(self, data, keep):
        both = list(self.pending) + list(self.zombie_pending)
        sid = data.draw(st.sampled_from(both))
        if sid in self.pending:
            res, labels = self.pending.pop(sid)
            zombie = False
        else:
            res, labels = self.zombie_pending.pop(sid)
            zombie = True
        if keep:
            if zombie:  # closed while the step ran: kept into freed blocks, and said so
                with pytest.raises(SessionNotFound, match="closed"):
                    self.table.commit(res)
            else:
                self.table.commit(res)
                self.expected[sid] += labels
        else:
            self.table.rollback(res)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(self._live()))
        before = self._snapshot()
        try:
            child = self.table.fork(sid)
        except SessionNotFound:
            self._sync_gone(before, False)
            return
        self.expected[child.id] = list(self.expected[sid])

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(self._live()))
        before = self._snapshot()
        n = data.draw(st.integers(0, len(self.expected[sid]) + 1))
        first = self.table._sessions[sid].first_block if sid in self.table._sessions else 0
        gone = 0 < n < shortest_truncate(first, self.window, self.bs)
        try:
            self.table.truncate(sid, n)
        except SessionNotFound:
            self._sync_gone(before, False)
            return
        except SessionBusy:
            assert sid in self.pending
            return
        except InvalidSessionArgument as e:
            if "no longer holds" in str(e):
                assert gone and n <= len(self.expected[sid])
                event("truncate past the window refused")
            else:
                assert n > len(self.expected[sid])
            return
        assert sid not in self.pending and n <= len(self.expected[sid]) and not gone
        del self.expected[sid][n:]

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def close(self, data):
        sid = data.draw(st.sampled_from(self._live()))
        before = self._snapshot()
        try:
            self.table.close(sid)
        except SessionNotFound:
            self._sync_gone(before, False)
            return
        del self.expected[sid]
        if sid in self.pending:
            self.zombie_pending[sid] = self.pending.pop(sid)
        # explicit pins of a closed session: unpin them (the zombie goes at the last unpin)
        for _ in range(self.pins.pop(sid, 0)):
            self.table.unpin(sid)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def pin(self, data):
        sid = data.draw(st.sampled_from(self._live()))
        before = self._snapshot()
        try:
            self.table.pin(sid)
        except SessionNotFound:
            self._sync_gone(before, False)
            return
        self.pins[sid] = self.pins.get(sid, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        sid = data.draw(st.sampled_from([k for k, v in self.pins.items() if v]))
        self.table.unpin(sid)
        self.pins[sid] -= 1

    @rule(dt=st.sampled_from([0.5, 3.0, 10.0]))
    def tick(self, dt):
        self.clock.now += dt

    @rule()
    def expire(self):
        before = self._snapshot()
        self.table.expire()
        self._sync_gone(before, False)

    @precondition(lambda self: len(self.expected) >= 2)
    @rule(data=st.data())
    def batch(self, data):
        ids = data.draw(st.lists(st.sampled_from(self._live()), min_size=2, max_size=4))
        ns = data.draw(st.lists(st.integers(1, 6), min_size=len(ids), max_size=len(ids)))
        before = self._snapshot()
        out = self.table.reserve_many(list(zip(ids, ns, strict=True)))
        # batch members are pinned: none of them may be evicted or expired by the others
        live = set(self.table._sessions)
        for sid in set(ids):
            if sid in before["sessions"] and self.clock.now - before["sessions"][sid][2] <= (
                before["sessions"][sid][3] or float("inf")
            ):
                assert sid in live, f"batch member {sid} went during its own batch"
        self._sync_gone(before, True)
        seen = set()
        kept = []
        for sid, n, r in zip(ids, ns, out, strict=True):
            if isinstance(r, CacheError):
                if sid in seen:
                    assert isinstance(r, SessionBusy)
                continue
            seen.add(sid)
            labels = self._labels(n)
            self._write(r, labels)
            kept.append((sid, r, labels))
        for sid, r, labels in kept:
            self.table.commit(r)
            if sid in self.expected:
                self.expected[sid] += labels

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def refcounts_match_block_tables(self):
        if not hasattr(self, "table"):
            return
        t = self.table
        refs = [0] * self.pool.num_blocks
        for s in list(t._sessions.values()) + list(t._zombies.values()):
            assert len(set(s.block_table)) == len(s.block_table), "a block twice in one table"
            for b in s.block_table:
                refs[b] += 1
        actual = [self.pool.refcount(b) for b in range(self.pool.num_blocks)]
        assert actual == refs, f"refcounts {actual} != references {refs}"
        used = sum(1 for r in refs if r)
        assert self.pool.num_used == used
        # free extents == unreferenced blocks, merged
        p = self.pool
        assert p._starts == sorted(p._starts)
        free = set()
        prev_end = None
        for start in p._starts:
            length = p._length[start]
            assert length >= 1 and p._end[start + length] == start
            assert prev_end is None or start > prev_end, "unmerged or overlapping extents"
            prev_end = start + length
            free.update(range(start, start + length))
        assert free == {b for b, r in enumerate(refs) if r == 0}
        assert len(p._end) == len(p._length) == len(p._starts)

    @invariant()
    def contents_match(self):
        if not hasattr(self, "table"):
            return
        assert set(self.expected) == set(self.table._sessions)
        for sid, labels in self.expected.items():
            s = self.table._sessions[sid]
            assert s.num_tokens == len(labels)
            assert s.first_block == first_needed_block(s.num_tokens, self.window, self.bs)
            if s.first_block:
                event("blocks out of the window freed")
            total = s.num_tokens if s.pending is None else s.num_tokens + s.pending.num_tokens
            assert len(s.block_table) == cdiv(total, self.bs) - s.first_block
            start = s.first_block * self.bs
            k, v = self.kv.read(
                s.block_table,
                s.num_tokens,
                start=min(start, s.num_tokens),
                first_block=s.first_block,
            )
            got = k.flatten().tolist()
            want = labels[start:]
            assert got == want, f"session {sid}: K {got} != written {want}"
            assert v.flatten().tolist() == [-x for x in want]

    def teardown(self):
        if not hasattr(self, "table"):
            return
        for res, _ in list(self.pending.values()):
            self.table.rollback(res)
        for res, _ in list(self.zombie_pending.values()):
            with pytest.raises(SessionNotFound):
                self.table.commit(res)
        for sid, n in self.pins.items():
            for _ in range(n):
                self.table.unpin(sid)
        self.table.expire()
        for sid in list(self.table._sessions):
            self.table.close(sid)
        assert not self.table._zombies
        assert self.pool.num_used == 0
        assert all(self.pool.refcount(b) == 0 for b in range(self.pool.num_blocks))


TableMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_session_table = TableMachine.TestCase

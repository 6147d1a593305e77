"""A session's key bound (engine/bounds.py KeyBound: max |k| and |v| of the K/V it holds, which
the overflow check counts the cached keys as) never goes stale: it follows the session
through steps, forks and truncates, and is recomputed from the K/V wherever a session
arrives whole (brought back from the spill tier, adopted by a new engine, moved in). Each
test reads the bound (Sessions.key_bound) and checks the decision it drives: a query that
would overflow against the cached key 1e19 is refused."""

from __future__ import annotations

import pytest
import torch

from mha_serve.engine import Engine, InvalidRequest
from tests.engine.test_overflow import (  # the tiny model's queries and keys apart
    step,
    tiny_engine,
    token,
)

BIG_KEY = float(torch.tensor(1e19))  # as float32 holds it
BIGGER_KEY = float(torch.tensor(3e19))
OVERFLOWS = 2e19  # a query whose score against BIG_KEY overflows float32 (with its margin)


def engine(spill_dir: str = "", prefix: str = "") -> Engine:
    return tiny_engine(
        spill_dir=spill_dir, spill_bytes=1 << 20 if spill_dir else 0, session_id_prefix=prefix
    )


def bound(e: Engine, sid: str) -> float:
    return e.sessions.key_bound(sid)


def assert_refuses_what_overflows(e: Engine, sid: str) -> None:
    """The cached key's bound refuses a query that would overflow against it (the new token's
    own key is 0: only the bound can see it), and keeps nothing of it."""
    n = e.get_session(sid).num_tokens
    with pytest.raises(InvalidRequest, match="attention scores of this input may overflow"):
        step(e, sid, token(q0=OVERFLOWS))
    assert e.get_session(sid).num_tokens == n


def session_with_big_key(e: Engine) -> str:
    sid = e.create_session("tiny").session_id
    assert bound(e, sid) == 0.0
    step(e, sid, token(k0=BIG_KEY))
    assert bound(e, sid) == BIG_KEY  # measured (bounds from its input could not clear it)
    return sid


def test_a_kept_step_keeps_the_larger_of_its_own_bound_and_its_sessions():
    e = engine()
    sid = session_with_big_key(e)
    step(e, sid, token(q0=3e18))  # measured (its input's bounds cannot clear it); its key 0
    assert bound(e, sid) == BIG_KEY
    step(e, sid, token(q0=1.0))  # cleared by its input's bounds: nothing measured
    assert bound(e, sid) == BIG_KEY
    assert_refuses_what_overflows(e, sid)


def test_a_fork_inherits_its_parents_bound_and_each_goes_its_own_way():
    e = engine()
    parent = session_with_big_key(e)
    child = e.fork_session(parent).session_id
    assert bound(e, child) == BIG_KEY
    assert_refuses_what_overflows(e, child)
    step(e, parent, token(k0=BIGGER_KEY))  # the parent's grows, the fork's does not
    assert (bound(e, parent), bound(e, child)) == (BIGGER_KEY, BIG_KEY)


def test_a_truncate_keeps_the_bound_while_tokens_stay_and_drops_it_with_the_last():
    e = engine()
    sid = session_with_big_key(e)
    step(e, sid, token(q0=1.0))
    e.truncate_session(sid, 1)  # the big key stays
    assert bound(e, sid) == BIG_KEY
    assert_refuses_what_overflows(e, sid)
    e.truncate_session(sid, 0)
    assert bound(e, sid) == 0.0
    assert step(e, sid, token(q0=OVERFLOWS)).session.num_tokens == 1  # no key to overflow on


def test_a_spilled_session_comes_back_with_its_bound_recomputed(tmp_path):
    e = engine(str(tmp_path / "spill"))
    sid = session_with_big_key(e)
    small = e.create_session("tiny").session_id
    step(e, small, token(q0=1.0, k0=2.0))  # cleared by bounds from its input: a proven bound
    proven = bound(e, small)
    assert proven >= 2.0
    assert sorted(e.spill_idle()) == sorted([sid, small])
    e.restore_session(sid)
    e.restore_session(small)
    assert bound(e, sid) == BIG_KEY
    assert bound(e, small) == 2.0 <= proven  # recomputed from the K/V themselves
    assert_refuses_what_overflows(e, sid)


def test_a_session_adopted_after_a_restart_keeps_its_bound(tmp_path):
    first = engine(str(tmp_path / "spill"))
    sid = session_with_big_key(first)
    assert first.spill_idle() == [sid]
    first.close_spill()
    second = engine(str(tmp_path / "spill"))
    assert second.adopt_spilled() == ([sid], [])
    second.restore_session(sid)
    assert bound(second, sid) == BIG_KEY
    assert_refuses_what_overflows(second, sid)


def test_a_moved_session_keeps_its_bound_there_and_back():
    """Moved a -> b, grown there, moved back b -> a under the same id: each time the bound
    is its K/V's, never what the first home knew of the id."""
    a, b = engine(prefix="a-"), engine(prefix="b-")
    sid = session_with_big_key(a)
    b.receive_session(a.pack_session(sid))
    a.session_moved(sid, "replica 'b'")
    assert bound(b, sid) == BIG_KEY
    assert_refuses_what_overflows(b, sid)
    step(b, sid, token(k0=BIGGER_KEY))
    a.receive_session(b.pack_session(sid))
    b.session_moved(sid, "replica 'a'")
    assert bound(a, sid) == BIGGER_KEY

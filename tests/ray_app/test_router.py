"""SessionRouter's choices, without a cluster: a session's call goes to the replica its id
names; once that one has left the view, to the replica SequenceDirectory says it moved to
(cached, looked up again when that one leaves too), waiting while the last known holder
lives (draining, moving) and no new home is known, and to one replica, the same for the
same id, which answers NOT_FOUND, once it is dead; a call for a replica rather than a
session (pinned_to) goes to any replica at once when that one has left; a live replica not
yet in the view is waited for; routers tell a replica's watchers when it leaves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from ray.serve.request_router import RequestRouter  # noqa: E402

from mha_serve.ray_app import leaving  # noqa: E402
from mha_serve.ray_app import router as router_module  # noqa: E402
from mha_serve.ray_app.ids import pinned_to  # noqa: E402
from mha_serve.ray_app.router import SessionRouter  # noqa: E402


def replica(unique_id: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id))


def pending(session_id: str):
    return SimpleNamespace(
        metadata=SimpleNamespace(session_id=session_id),
        routing_context=SimpleNamespace(should_backoff=False),
    )


@pytest.fixture
def router(monkeypatch):
    """A SessionRouter whose base class keeps nothing, and whose actor lookup answers from
    `alive` (no GCS here)."""
    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)
    router = SessionRouter.__new__(SessionRouter)
    router._gone, router._seen, router._deployment_id = {}, {}, None
    router._view, router._homes = set(), {}
    router.alive, router.asked = set(), []
    router.directory, router.looked_up = {}, []

    def home_of(session_id: str):
        router.looked_up.append(session_id)
        return router.directory.get(session_id)

    router._home_of = home_of

    def lookup(unique_id: str, deployment_id) -> bool:
        router.asked.append(unique_id)
        return unique_id in router.alive

    monkeypatch.setattr(router_module, "replica_alive", lookup)
    return router


def choose(router, candidates, session_id: str):
    return asyncio.run(router.choose_replicas(candidates, pending(session_id)))


def test_a_session_goes_to_its_replica_and_the_rest_spread(router):
    a, b = replica("a"), replica("b")
    router.update_replicas([a, b])
    assert choose(router, [a, b], pinned_to("b")) == [[b]]
    (pair,) = choose(router, [a, b], "")
    assert sorted(r.replica_id.unique_id for r in pair) == ["a", "b"]


def session(replica_id: str, n: int = 1) -> str:
    return f"{replica_id}-{n:032x}"


def test_a_moved_session_goes_to_its_new_home_and_waits_while_it_moves(router):
    """b is stopping (left the view, still alive): its session waits until the directory
    knows its new home, then goes there, the home cached; moved again (c stops too), it is
    looked up again; once its last holder is dead with no home known, it is gone."""
    a, b, c = replica("a"), replica("b"), replica("c")
    router.update_replicas([a, b, c])
    sid = session("b")
    router.alive = {"a", "b", "c"}
    assert choose(router, [a, b, c], sid) == [[b]]
    assert router.looked_up == []  # its replica runs: no lookup
    router.update_replicas([a, c])  # Ray stops b
    assert choose(router, [a, c], sid) == []  # b drains and moves it: wait
    router.directory[sid] = "c"  # c took it
    assert choose(router, [a, c], sid) == [[c]]
    assert choose(router, [a, c], sid) == [[c]]
    assert router.looked_up == [sid, sid]  # the second from the cache
    router.update_replicas([a])  # c stops too: b's session moves again, to a
    assert choose(router, [a], sid) == []  # the directory still says c, alive: wait
    router.directory[sid] = "a"
    assert choose(router, [a], sid) == [[a]]
    del router.directory[sid]
    router._homes.clear()
    router.alive = {"a"}  # b and c dead, no home known: lost
    assert choose(router, [a], sid) == [[a]]


def test_a_session_waits_while_the_directory_does_not_answer(router):
    """A directory restarting may know the session's home: the call waits, not NOT_FOUND."""
    a = replica("a")
    router.update_replicas([a])
    sid = session("dead")

    def down(session_id: str):
        raise TimeoutError("SequenceDirectory restarting")

    router._home_of = down
    assert choose(router, [a], sid) == []
    router._home_of = lambda session_id: "a"  # back, its map rebuilt
    assert choose(router, [a], sid) == [[a]]


def test_a_gone_session_is_answered_by_the_same_replica_from_every_router(router):
    replicas = [replica(x) for x in "abc"]
    router.update_replicas(replicas)
    router.alive = {"a", "b", "c"}
    for n in range(8):
        sid = session("dead", n)
        (first,) = choose(router, replicas, sid)
        assert choose(router, list(reversed(replicas)), sid) == [first]  # not by order


def test_a_replica_leaving_the_view_is_told_to_its_watchers_once(router):
    told = []
    leaving.when_leaving("b", lambda: told.append("b"))
    a, b = replica("a"), replica("b")
    router.update_replicas([a, b])
    assert told == []
    router.update_replicas([a])
    router.update_replicas([a, b])
    router.update_replicas([a])
    assert told == ["b"]


def test_a_replica_that_left_the_view_answers_at_once_though_it_still_drains(router):
    a, b = replica("a"), replica("b")
    router.update_replicas([a, b])
    router.update_replicas([a])  # Ray stops b (downscale): its actor still lives, draining
    router.alive = {"a", "b"}
    assert choose(router, [a], pinned_to("b")) == [[a]]  # a answers NOT_FOUND
    assert router.asked == []  # no lookup: having left the view says enough


def test_an_unannounced_live_replica_is_waited_for_and_a_dead_one_is_not(router):
    a = replica("a")
    router.update_replicas([a])
    router.alive = {"a", "new"}
    assert choose(router, [a], pinned_to("new")) == []  # wait for the next update
    assert choose(router, [a], pinned_to("dead")) == [[a]]
    assert choose(router, [a], pinned_to("dead")) == [[a]]
    assert router.asked == ["new", "dead"]  # a dead one is remembered


def test_calls_without_a_session_take_the_shorter_queue_and_near_ones_tie(router):
    """Ray takes the shorter queue of the pair SessionRouter offers; queues within one of
    each other (as far as Ray's cache of them can be off) are a tie: either, at random."""
    a, b = replica("a"), replica("b")
    router.update_replicas([a, b])
    cached = {"a": 0, "b": 1}
    router._replica_queue_len_cache = SimpleNamespace(get=lambda rid: cached[rid.unique_id])
    firsts = set()
    for _ in range(64):
        ranks = choose(router, [a, b], "")
        assert [len(rank) for rank in ranks] == [1, 1]  # a tie: the first, then the other
        firsts.add(ranks[0][0].replica_id.unique_id)
    assert firsts == {"a", "b"}
    cached["b"] = 5
    (pair,) = choose(router, [a, b], "")  # not a tie: Ray compares them
    assert sorted(r.replica_id.unique_id for r in pair) == ["a", "b"]

"""lost.py without a cluster: SequenceDirectory's record of the sessions a stopping replica
could not move (bounded, newest kept), and the answering replica's decision: a session its
replica reported counts move_failed and its NOT_FOUND says why, any other replica_killed
(also when the directory does not answer), each counted once however often it is asked;
the NOT_FOUND names the replica that held the session last."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from mha_serve.ray_app.lost import FailedMoves, Loss, LostSessions, gone_details


def lost(reason: str) -> float:
    return REGISTRY.get_sample_value("mha_serve_sessions_lost_total", {"reason": reason})


def test_failed_moves_keep_the_newest_with_why():
    failed = FailedMoves(limit=3)
    failed.record({"a-1": "no room", "a-2": "no room"})
    failed.record({"b-1": "out of time", "b-2": "out of time"})
    assert len(failed) == 3
    assert failed.loss("a-1").why is None  # the oldest went
    assert (failed.loss("a-2").why, failed.loss("b-1").why, failed.loss("b-2").why) == (
        "no room",
        "out of time",
        "out of time",
    )
    failed.record({"a-2": "nowhere"})  # reported again (a later stop): newest, new reason
    failed.record({"c-1": "nowhere"})
    assert failed.loss("b-1").why is None and failed.loss("a-2").why == "nowhere"
    assert failed.loss("never-reported").why is None
    failed.record({})
    assert len(failed) == 3


def test_failed_moves_keep_the_replica_that_reported_them():
    failed = FailedMoves()
    failed.record({"a-1": "no room"}, replica="b")  # a-1 moved to b, which then stopped
    failed.record({"b-1": "no room"})  # (a report that names no replica)
    assert failed.loss("a-1") == Loss("no room", "b")
    assert failed.loss("b-1") == Loss("no room", None)
    assert failed.loss("never-reported") == Loss(None, None)


def test_a_reported_session_counts_move_failed_once_and_says_why():
    asked: list[str] = []

    async def why_lost(session_id: str) -> Loss:
        asked.append(session_id)
        return {"r1-a": Loss("no replica took it: no room", "r2")}.get(session_id, Loss())

    async def main() -> list[Loss]:
        lost_here = LostSessions(why_lost)
        # At once: the second and third arrive while the first one's question is pending.
        at_once = [lost_here.why("r1-a") for _ in range(3)]
        answers = await asyncio.gather(*at_once, lost_here.why("r1-b"))
        answers.append(await lost_here.why("r1-a"))  # later: known, not asked again
        return answers

    failed, killed = lost("move_failed"), lost("replica_killed")
    answers = asyncio.run(main())
    reported = Loss("no replica took it: no room", "r2")
    assert answers == [*([reported] * 3), Loss(), reported]
    assert sorted(asked) == ["r1-a", "r1-b"]  # one question per session
    assert (lost("move_failed"), lost("replica_killed")) == (failed + 1, killed + 1)


def test_no_answer_from_the_directory_counts_replica_killed():
    async def unreachable(session_id: str) -> Loss:
        raise RuntimeError("SequenceDirectory is restarting")

    async def main() -> list[Loss]:
        no_directory = LostSessions(None)  # a replica made without one
        silent = LostSessions(unreachable)
        return [await no_directory.why("r1-a"), await silent.why("r1-b")]

    failed, killed = lost("move_failed"), lost("replica_killed")
    assert asyncio.run(main()) == [Loss(), Loss()]
    assert (lost("move_failed"), lost("replica_killed")) == (failed, killed + 2)


def test_sessions_past_the_limit_are_asked_and_counted_again():
    asked: list[str] = []

    async def why_lost(session_id: str) -> Loss:
        asked.append(session_id)
        return Loss("nowhere", None)

    async def main() -> None:
        lost_here = LostSessions(why_lost, limit=2)
        for session_id in ("a", "b", "c", "a"):  # "a" forgotten once "c" came
            await lost_here.why(session_id)

    failed = lost("move_failed")
    asyncio.run(main())
    assert asked == ["a", "b", "c", "a"]
    assert lost("move_failed") == failed + 4


def test_not_found_details_say_how_the_session_was_lost():
    killed = gone_details("r1-a", "r1", None)
    assert killed == (
        "session 'r1-a' is gone: it lived on Ray Serve replica 'r1', which is no longer "
        "running or is stopping (it died, or was scaled down or replaced), and its KV cache "
        "went with it; create a new session and send its tokens again"
    )
    failed = gone_details("r1-a", "r1", "no replica took it: no room", what="sequence 7")
    assert failed == (
        "sequence 7 (session 'r1-a') is gone: it lived on Ray Serve replica 'r1', which "
        "stopped (scaled down or replaced) and could not move it to another replica (no "
        "replica took it: no room), so its KV cache went with it; start it again with "
        "sequence_start and send its tokens again"
    )

"""The batcher alone: batch forming, limits, keys, backpressure, deadlines, cancellation, close."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mha_serve.batching import (
    Batcher,
    BatchPolicy,
    Closed,
    DeadlineExceeded,
    ModelLanes,
    QueueFull,
)
from mha_serve.batching.batcher import ArrivalStats

WAIT_S = 5.0  # upper bound for anything that should happen "soon"


class FakeClock:
    """The batcher's clock, moved only by the test: frozen, a wait for company never ends,
    so a batch that completes did not wait for one."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    """A run_batch that records each batch and can be held closed by a gate."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, payloads: list) -> list:
        self.entered.set()
        assert self.gate.wait(WAIT_S), "gate never opened"
        self.batches.append(list(payloads))
        return [p * 10 if isinstance(p, int) else p for p in payloads]


def policy(**kw) -> BatchPolicy:
    return BatchPolicy(**{"max_queue_delay_s": 0.05, **kw})


async def wait_entered(rec: Recorder) -> None:
    assert await asyncio.to_thread(rec.entered.wait, WAIT_S)


async def test_concurrent_items_share_a_batch_and_results_go_to_their_callers():
    rec = Recorder()
    b = Batcher("m", rec, policy())
    results = await asyncio.gather(*(b.submit(i, sequences=1, length=4) for i in range(6)))
    assert [r for r, _ in results] == [i * 10 for i in range(6)]
    assert rec.batches == [list(range(6))]
    assert all(info.batch_size == 6 and info.num_requests == 6 for _, info in results)
    await b.close()


async def test_batch_size_and_token_limits():
    rec = Recorder()
    b = Batcher("m", rec, policy(max_batch_size=4))
    await asyncio.gather(*(b.submit(i, sequences=1, length=1) for i in range(10)))
    assert [len(batch) for batch in rec.batches] == [4, 4, 2]
    rec.batches.clear()
    # 100-token sequences with a 250-token budget: two per batch.
    c = Batcher("n", rec, policy(max_batch_tokens=250))
    await asyncio.gather(*(c.submit(i, sequences=1, length=100) for i in range(5)))
    assert [len(batch) for batch in rec.batches] == [2, 2, 1]
    await b.close()
    await c.close()


async def test_an_oversized_first_item_still_runs_alone():
    rec = Recorder()
    b = Batcher("m", rec, policy(max_batch_size=2, max_batch_tokens=10))
    (result, info), *_ = await asyncio.gather(b.submit(1, sequences=5, length=50))
    assert result == 10 and info.batch_size == 5
    await b.close()


async def test_items_with_different_keys_never_share_a_batch():
    rec = Recorder()
    b = Batcher("m", rec, policy())
    await asyncio.gather(*(b.submit(i, sequences=1, length=1, key=i % 2) for i in range(6)))
    assert sorted(map(sorted, rec.batches)) == [[0, 2, 4], [1, 3, 5]]
    await b.close()


async def test_queue_bounds_refuse_at_once():
    rec = Recorder()
    rec.gate.clear()
    b = Batcher("m", rec, policy(max_queue_requests=2, max_queue_tokens=100, max_batch_size=1))
    running = asyncio.ensure_future(b.submit(0, sequences=1, length=1))
    await wait_entered(rec)  # item 0 is computing; the queue is empty again
    queued = [asyncio.ensure_future(b.submit(i, sequences=1, length=10)) for i in (1, 2)]
    await asyncio.sleep(0)
    refused = b.submit(3, sequences=1, length=1)
    with pytest.raises(QueueFull, match=r"2 requests are queued \(limit 2\)"):
        refused.send(None)  # refused at once: before the coroutine's first suspension
    queued[1].cancel()
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match="10 tokens are queued and this request adds 91"):
        await b.submit(4, sequences=1, length=91)
    rec.gate.set()
    assert (await running)[0] == 0 and (await queued[0])[0] == 10
    assert b.queued_requests == 0 and b.queued_tokens == 0
    await b.close()


async def test_expired_items_are_dropped_before_compute():
    rec = Recorder()
    rec.gate.clear()
    clock = FakeClock()
    b = Batcher("m", rec, policy(max_batch_size=1), clock=clock)
    running = asyncio.ensure_future(b.submit(0, sequences=1, length=1))
    await wait_entered(rec)
    late = asyncio.ensure_future(b.submit(1, sequences=1, length=1, deadline=clock() + 0.05))
    await asyncio.sleep(0)
    clock.advance(0.1)  # past its deadline while the lane is busy
    rec.gate.set()
    with pytest.raises(DeadlineExceeded, match="before compute started"):
        await late
    await running
    assert rec.batches == [[0]]  # item 1 never reached run_batch
    await b.close()


async def test_cancelled_caller_leaves_the_queue():
    rec = Recorder()
    rec.gate.clear()
    b = Batcher("m", rec, policy(max_batch_size=1))
    running = asyncio.ensure_future(b.submit(0, sequences=1, length=1))
    await wait_entered(rec)
    gone = asyncio.ensure_future(b.submit(1, sequences=1, length=7))
    await asyncio.sleep(0)
    assert b.queued_requests == 1 and b.queued_tokens == 7
    gone.cancel()
    await asyncio.sleep(0)
    assert b.queued_requests == 0 and b.queued_tokens == 0
    rec.gate.set()
    await running
    assert rec.batches == [[0]]
    await b.close()


async def test_event_loop_stays_free_while_a_batch_computes():
    rec = Recorder()
    rec.gate.clear()
    b = Batcher("m", rec, policy())
    running = asyncio.ensure_future(b.submit(0, sequences=1, length=1))
    await wait_entered(rec)  # run_batch holds its thread at the gate: were that thread the
    ticks = [await asyncio.sleep(0, result=i) for i in range(3)]  # loop's, none would run
    assert ticks == [0, 1, 2]
    rec.gate.set()
    await running
    await b.close()


async def test_errors_reach_only_their_callers():
    def run(payloads):
        return [ValueError(f"bad {p}") if p == 2 else p for p in payloads]

    b = Batcher("m", run, policy())
    results = await asyncio.gather(
        *(b.submit(i, sequences=1, length=1) for i in range(4)), return_exceptions=True
    )
    assert [r if isinstance(r, Exception) else r[0] for r in results][:2] == [0, 1]
    assert isinstance(results[2], ValueError) and str(results[2]) == "bad 2"
    assert results[3][0] == 3

    def broken(payloads):
        raise RuntimeError("device lost")

    c = Batcher("n", broken, policy())
    results = await asyncio.gather(
        *(c.submit(i, sequences=1, length=1) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) and "device lost" in str(r) for r in results)
    await b.close()
    await c.close()


async def test_close_finishes_the_running_batch_and_refuses_new_items():
    rec = Recorder()
    rec.gate.clear()
    b = Batcher("m", rec, policy(max_batch_size=1))
    running = asyncio.ensure_future(b.submit(0, sequences=1, length=1))
    await wait_entered(rec)
    queued = asyncio.ensure_future(b.submit(2, sequences=1, length=1))
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(b.close())
    await asyncio.sleep(0.01)
    rec.gate.set()
    await closing
    assert (await running)[0] == 0
    with pytest.raises(Closed, match="shutting down"):  # (the servicer: UNAVAILABLE)
        await queued
    with pytest.raises(Closed, match="shutting down"):
        await b.submit(1, sequences=1, length=1)


async def test_weights_lane_runs_one_request_per_batch_beside_the_fast_lane():
    fast, slow = Recorder(), []
    slow_gate = threading.Event()

    def run_one(p):
        slow.append(p)
        assert slow_gate.wait(WAIT_S)
        return p

    lanes = ModelLanes("m", run_batch=fast, run_one=run_one, policy=policy())
    heavy = [
        asyncio.ensure_future(
            lanes.submit(f"w{i}", need_weights=True, sequences=1, length=1, key=None, deadline=None)
        )
        for i in range(2)
    ]
    await asyncio.sleep(0.05)
    # The weights lane is stuck; fast requests are still served, batched together.
    quick = await asyncio.gather(
        *(
            lanes.submit(i, need_weights=False, sequences=1, length=1, key=None, deadline=None)
            for i in range(3)
        )
    )
    assert [r for r, _ in quick] == [0, 10, 20] and fast.batches == [[0, 1, 2]]
    slow_gate.set()
    assert [(await h)[1].num_requests for h in heavy] == [1, 1]
    await lanes.close()


def test_bad_policies_fail_with_the_fix():
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer, got 0"):
        BatchPolicy(max_batch_size=0)
    with pytest.raises(ValueError, match="max_queue_delay_s must be in 0..1 s"):
        BatchPolicy(max_queue_delay_s=5)


def arrivals(events) -> ArrivalStats:
    """ArrivalStats after (key, time, found the lane busy with its key) arrivals."""
    stats = ArrivalStats()
    for key, now, busy in events:
        stats.note(key, now, busy)
    return stats


def test_a_lone_client_does_not_wait_for_company():
    """One request at a time, further apart than the delay: never a wait."""
    stats = arrivals(("k", 0.6 * i, False) for i in range(5))
    assert stats.company_wait("k", 0.5) == 0.0


def test_a_fast_closed_loop_client_does_not_wait_for_company():
    """A decode stream sends its next step as soon as the last one answers: arrivals far
    closer together than the delay, but none ever finds another of its key in the lane."""
    stats = arrivals(("k", 1e-4 * i, False) for i in range(50))
    assert stats.gap_ewma < 0.5 and stats.company_wait("k", 0.5) == 0.0
    # Once other callers overlap it, the same lane waits for company again.
    for i in range(3):
        stats.note("k", 0.01 + 1e-4 * i, True)
    assert stats.company_wait("k", 0.5) == 0.5


def test_bursty_arrivals_wait_for_company():
    stats = arrivals([("k", 0.0, False)] + [("k", 0.0, True)] * 3)  # a burst of 4
    stats.note("k", 0.02, False)  # a trickle, closer together than the delay
    assert stats.company_wait("k", 0.2) == 0.2


def test_a_closed_loop_client_does_not_wait_beside_traffic_of_another_key():
    """A decode stream (key "s") on a lane that also carries a steady trickle of stateless
    requests (key "a"): the trickle keeps waiting for company, the stream never does."""
    events = [("a", 0.0, False)] + [("a", 0.0, True)] * 3
    for i in range(30):  # a trickle of "a" every 35 ms, many arriving while "a" forms
        events.append(("a", 0.035 * (i + 1), i % 3 != 0))
        events.append(("s", 0.035 * (i + 1) + 0.001, False))  # a step between them
    stats = arrivals(events)
    assert stats.company_wait("a", 0.3) == 0.3
    assert stats.company_wait("s", 0.3) == 0.0


def test_a_long_steady_trickle_keeps_being_batched():
    """Open-loop arrivals closer together than the delay: those that come while a batch is
    forming count as company, so the lane keeps waiting for them round after round."""
    events = [("k", 0.0, False)] + [("k", 0.0, True)] * 3
    # 30 arrivals 20 ms apart with a 0.2 s delay: about 9 in 10 find a batch forming.
    events += [("k", 0.02 * (i + 1), i % 10 != 0) for i in range(30)]
    stats = arrivals(events)
    assert stats.keeps_company("k") and stats.company_wait("k", 0.2) == 0.2


def test_overlap_is_remembered_for_a_bounded_number_of_keys():
    stats = arrivals((("key", i), 0.0, True) for i in range(200))
    assert len(stats.overlap) == 64 and ("key", 199) in stats.overlap


async def test_a_waiting_batch_is_flushed_by_size_and_a_lone_one_goes_at_once():
    """On a frozen clock a wait for company never ends: a batch that completes either did
    not wait or was flushed by its size, never by time."""
    rec = Recorder()
    b = Batcher("m", rec, BatchPolicy(max_queue_delay_s=0.5, max_batch_size=3), clock=FakeClock())
    for i in range(3):  # a lone client: no company ever, so no wait
        await asyncio.wait_for(b.submit(i, sequences=1, length=1), WAIT_S)
    await asyncio.wait_for(
        asyncio.gather(*(b.submit(i, sequences=1, length=1) for i in range(3, 6))), WAIT_S
    )
    assert b.arrivals.keeps_company(None)  # the burst overlapped
    trickle = [asyncio.ensure_future(b.submit(i, sequences=1, length=1)) for i in range(6, 9)]
    await asyncio.wait_for(asyncio.gather(*trickle), WAIT_S)  # flushed at max_batch_size
    assert rec.batches[:3] == [[0], [1], [2]] and [6, 7, 8] in rec.batches
    await b.close()


async def test_a_batch_waiting_for_company_lets_a_lone_request_of_another_key_go():
    """Key "a" keeps company, so its batch waits (forever, on a frozen clock); a step of
    key "s", which never has company, makes it stop waiting: both complete."""
    rec = Recorder()
    frozen = FakeClock()
    b = Batcher("m", rec, BatchPolicy(max_queue_delay_s=0.5, max_batch_size=4), clock=frozen)
    # A burst of 4 (flushed by its size): key "a" now keeps company.
    await asyncio.gather(*(b.submit("a", sequences=1, length=1, key="a") for _ in range(4)))
    waiting = asyncio.ensure_future(b.submit("a", sequences=1, length=1, key="a"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not waiting.done()  # waiting for company
    await asyncio.wait_for(b.submit("s", sequences=1, length=1, key="s"), WAIT_S)
    await asyncio.wait_for(waiting, WAIT_S)
    assert rec.batches[-2:] == [["a"], ["s"]]  # the waiting batch ran early, then the step
    await b.close()


async def test_unequal_lengths_wait_for_a_batch_of_their_own():
    rec = Recorder()
    b = Batcher("m", rec, policy(min_batch_fill=0.8))
    # 16-token requests and one 512-token request arrive together.
    lengths = [16, 16, 512, 16, 15, 16]
    await asyncio.gather(*(b.submit(i, sequences=1, length=n) for i, n in enumerate(lengths)))
    assert rec.batches == [[0, 1, 3, 4, 5], [2]]  # 15 pads to 16 (94% full); 512 alone
    rec.batches.clear()
    loose = Batcher("n", rec, policy(min_batch_fill=0.0))
    await asyncio.gather(*(loose.submit(i, sequences=1, length=n) for i, n in enumerate(lengths)))
    assert rec.batches == [list(range(6))]
    with pytest.raises(ValueError, match="min_batch_fill must be in 0..1"):
        BatchPolicy(min_batch_fill=1.5)
    await b.close()
    await loose.close()


async def test_items_are_removed_by_identity_never_by_comparing_payloads():
    # Arrays cannot be compared with ==; the queue must still skip, take and withdraw them.
    import numpy as np

    arrays = [np.zeros((1, n)) for n in (4, 9, 4, 9, 4)]

    def run(payloads):
        return [p.shape[1] for p in payloads]

    b = Batcher("m", run, policy(min_batch_fill=1.0))
    results = await asyncio.gather(*(b.submit(a, sequences=1, length=a.shape[1]) for a in arrays))
    assert [r for r, _ in results] == [4, 9, 4, 9, 4]
    rec = Recorder()
    rec.gate.clear()
    c = Batcher("n", rec, policy(max_batch_size=1))
    running = asyncio.ensure_future(c.submit(np.zeros(3), sequences=1, length=1))
    await wait_entered(rec)
    queued = [
        asyncio.ensure_future(c.submit(np.zeros(k + 2), sequences=1, length=1)) for k in range(3)
    ]
    await asyncio.sleep(0)
    queued[1].cancel()  # withdraw from the middle of the queue
    await asyncio.sleep(0)
    assert c.queued_requests == 2
    rec.gate.set()
    await running
    assert [len((await q)[0]) for q in (queued[0], queued[2])] == [2, 4]
    await b.close()
    await c.close()


async def test_lanes_run_on_the_executors_given_and_leave_them_running():
    from concurrent.futures import ThreadPoolExecutor

    shared = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shared")
    side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="side")

    def thread_name(payloads: list) -> list:
        return [threading.current_thread().name for _ in payloads]

    a, b = (
        ModelLanes(
            name,
            run_batch=thread_name,
            run_one=lambda p: thread_name([p])[0],
            policy=policy(),
            fast_executor=shared,
            weights_executor=side,
        )
        for name in ("a", "b")
    )
    kw = {"sequences": 1, "length": 1, "key": None, "deadline": None}
    names = [
        (await a.submit(0, need_weights=False, **kw))[0],
        (await b.submit(0, need_weights=False, **kw))[0],
        (await a.submit(0, need_weights=True, **kw))[0],
    ]
    assert names[0] == names[1] and names[0].startswith("shared")  # both models' fast lanes
    assert names[2].startswith("side")
    await a.close()
    # Closing a lane does not shut down an executor it was given: b still computes.
    assert (await b.submit(0, need_weights=False, **kw))[0] == names[0]
    await b.close()
    shared.shutdown()
    side.shutdown()


async def test_a_failing_batch_observer_neither_hangs_callers_nor_stops_the_lane():
    def observer(info):
        raise RuntimeError("metrics backend down")

    b = Batcher("m", Recorder(), policy(), on_batch=observer)
    for i in range(2):
        result, _ = await asyncio.wait_for(b.submit(i, sequences=1, length=1), WAIT_S)
        assert result == i * 10
    await b.close()


async def test_a_run_batch_returning_the_wrong_count_fails_that_batch_only():
    calls = []

    def short(payloads):
        calls.append(len(payloads))
        return payloads[:-1] if len(calls) == 1 else payloads

    b = Batcher("m", short, policy())
    with pytest.raises(RuntimeError, match="returned 0 results for 1 items"):
        await b.submit(5, sequences=1, length=1)
    assert (await b.submit(6, sequences=1, length=1))[0] == 6
    await b.close()


async def test_a_run_batch_returning_no_list_fails_that_batch_and_the_lane_goes_on():
    calls = []

    def flaky(payloads):
        calls.append(payloads)
        return None if len(calls) == 1 else payloads

    b = Batcher("m", flaky, policy())
    with pytest.raises(TypeError):
        await asyncio.wait_for(b.submit(1, sequences=1, length=1), WAIT_S)
    assert (await asyncio.wait_for(b.submit(2, sequences=1, length=1), WAIT_S))[0] == 2
    await b.close()


async def test_a_shut_down_executor_fails_the_batch_instead_of_hanging():
    from concurrent.futures import ThreadPoolExecutor

    gone = ThreadPoolExecutor(max_workers=1)
    gone.shutdown()
    b = Batcher("m", Recorder(), policy(), executor=gone)
    with pytest.raises(RuntimeError, match="shutdown"):
        await asyncio.wait_for(b.submit(1, sequences=1, length=1), WAIT_S)
    await b.close()


async def b_queued_behind_a(shared, clock=time.monotonic) -> tuple:
    """Lanes a and b on one thread: a's batch holds it (its gate closed), b's item waits.
    Returns (a's gate, a, b, a's pending result, b's pending result)."""
    busy = Recorder()
    busy.gate.clear()
    a = Batcher("a", busy, policy(), executor=shared)
    b = Batcher("b", Recorder(), policy(), executor=shared, clock=clock)
    held = asyncio.ensure_future(a.submit(1, sequences=1, length=1))
    await wait_entered(busy)
    waiting = asyncio.ensure_future(b.submit(2, sequences=1, length=1))
    return busy.gate, a, b, held, waiting


async def test_time_waiting_for_a_shared_thread_counts_as_queue_not_compute():
    from concurrent.futures import ThreadPoolExecutor

    shared = ThreadPoolExecutor(max_workers=1)
    clock = FakeClock()
    gate, a, b, held, waiting = await b_queued_behind_a(shared, clock)
    await asyncio.sleep(0)
    clock.advance(0.3)  # b's batch waits behind a's on the one thread
    gate.set()
    (_, info) = await asyncio.wait_for(waiting, WAIT_S)
    assert info.queue_s == pytest.approx(0.3) and info.compute_s == 0.0
    await held
    await a.close()
    await b.close()
    shared.shutdown()


async def test_closing_a_lane_whose_batch_waits_behind_another_lane_finishes_that_batch():
    from concurrent.futures import ThreadPoolExecutor

    shared = ThreadPoolExecutor(max_workers=1)
    gate, a, b, held, waiting = await b_queued_behind_a(shared)
    await asyncio.sleep(0.05)
    closing = asyncio.ensure_future(b.close())
    await asyncio.sleep(0.05)
    assert not closing.done(), "close returned while its batch was still queued"
    gate.set()
    await asyncio.wait_for(closing, WAIT_S)
    assert (await waiting)[0] == 20 and (await held)[0] == 10
    await a.close()
    shared.shutdown()


# ----- a lone small item runs on the caller's thread (no crossing) -----------------------


class ThreadRecorder(Recorder):
    """A Recorder that also notes the thread each batch ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def __call__(self, payloads: list) -> list:
        self.threads.append(threading.get_ident())
        return super().__call__(payloads)


def inline_batcher(rec: Recorder, small=lambda p: True, **kw) -> Batcher:
    return Batcher("m", rec, policy(**kw), inline=small, run_inline=rec)


async def test_a_lone_small_item_runs_on_the_loops_thread_with_the_same_result():
    rec = ThreadRecorder()
    b = inline_batcher(rec)
    result, info = await b.submit(3, sequences=1, length=1)
    assert result == 30 and info.batch_size == 1 and info.num_requests == 1
    assert rec.threads == [threading.get_ident()] and b.num_inline == 1
    await b.close()


async def test_items_that_come_together_batch_as_before_on_the_lanes_thread():
    """Three callers at once: each is not alone after its turn of the loop, so all three
    queue, and they share one batch on the lane's thread."""
    rec = ThreadRecorder()
    b = inline_batcher(rec, max_queue_delay_s=0.0)
    results = await asyncio.gather(*(b.submit(i, sequences=1, length=1) for i in (1, 2, 3)))
    assert [r for r, _ in results] == [10, 20, 30]
    assert b.num_inline == 0 and rec.batches == [[1, 2, 3]]
    assert threading.get_ident() not in rec.threads
    await b.close()


async def test_a_busy_lane_or_a_large_item_goes_through_the_queue():
    rec = ThreadRecorder()
    b = inline_batcher(rec, small=lambda p: p < 100)
    assert (await b.submit(500, sequences=1, length=1))[0] == 5000  # large: the lane
    assert b.num_inline == 0 and rec.threads[-1] != threading.get_ident()
    assert (await b.submit(1, sequences=1, length=1))[0] == 10  # small and alone: here
    assert b.num_inline == 1 and rec.threads[-1] == threading.get_ident()
    # the lane busy with a large item: a small one meanwhile queues behind it
    rec.gate.clear()
    rec.entered.clear()
    big = asyncio.create_task(b.submit(700, sequences=1, length=1))
    await wait_entered(rec)
    small = asyncio.create_task(b.submit(2, sequences=1, length=1))
    await asyncio.sleep(0.01)
    assert not small.done()
    rec.gate.set()
    assert (await big)[0] == 7000 and (await small)[0] == 20
    assert b.num_inline == 1 and rec.threads[-1] != threading.get_ident()
    await b.close()


async def test_an_inline_item_keeps_the_errors_and_deadlines_of_the_lane():
    def run(payloads):
        if payloads[0] == "boom":
            raise RuntimeError("the whole batch failed")
        return [ValueError("its own error")]

    clock = FakeClock()
    b = Batcher("m", run, policy(), clock=clock, inline=lambda p: True, run_inline=run)
    with pytest.raises(ValueError, match="its own error"):
        await b.submit("x", sequences=1, length=1)
    with pytest.raises(RuntimeError, match="the whole batch failed"):
        await b.submit("boom", sequences=1, length=1)
    with pytest.raises(DeadlineExceeded):
        await b.submit("x", sequences=1, length=1, deadline=clock.now - 1)
    await b.close()
    with pytest.raises(Closed):
        await b.submit("x", sequences=1, length=1)

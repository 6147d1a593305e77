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

WAIT_S = 5.0  # upper bound for anything that should happen "soon"


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
    started = time.monotonic()
    with pytest.raises(QueueFull, match=r"2 requests are queued \(limit 2\)"):
        await b.submit(3, sequences=1, length=1)
    assert time.monotonic() - started < 0.5  # refused at once, not after a wait
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
    b = Batcher("m", rec, policy(max_batch_size=1))
    running = asyncio.ensure_future(b.submit(0, sequences=1, length=1))
    await wait_entered(rec)
    late = asyncio.ensure_future(
        b.submit(1, sequences=1, length=1, deadline=time.monotonic() + 0.05)
    )
    await asyncio.sleep(0.1)
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
    await wait_entered(rec)
    started = time.monotonic()
    await asyncio.sleep(0.01)  # would hang if run_batch ran on the loop
    assert time.monotonic() - started < 1.0
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


async def test_a_lone_client_does_not_wait_for_company():
    rec = Recorder()
    b = Batcher("m", rec, BatchPolicy(max_queue_delay_s=0.5))
    for i in range(3):  # one request at a time, as a single client sends them
        started = time.monotonic()
        _, info = await b.submit(i, sequences=1, length=1)
        assert time.monotonic() - started < 0.4, "waited for the 0.5 s batch delay"
        assert info.queue_s < 0.4
        await asyncio.sleep(0.6)  # arrivals further apart than the delay
    await b.close()


async def test_a_fast_closed_loop_client_does_not_wait_for_company():
    """A decode stream sends its next step as soon as the last one answers: arrivals far
    closer together than the delay, but none can ever join another's batch."""
    rec = Recorder()
    b = Batcher("m", rec, BatchPolicy(max_queue_delay_s=0.5))
    for i in range(8):  # back to back: gaps of well under a millisecond
        started = time.monotonic()
        _, info = await b.submit(i, sequences=1, length=1)
        assert time.monotonic() - started < 0.4, f"step {i} waited for the 0.5 s batch delay"
        assert info.queue_s < 0.4
    assert rec.batches == [[i] for i in range(8)]
    # Once other callers overlap it, the same lane waits for company again.
    first = asyncio.ensure_future(b.submit(100, sequences=1, length=1))
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(b.submit(i, sequences=1, length=1)) for i in (101, 102)]
    await asyncio.gather(first, *rest)
    trickle = []
    for i in range(103, 106):
        trickle.append(asyncio.ensure_future(b.submit(i, sequences=1, length=1)))
        await asyncio.sleep(0.02)
    await asyncio.gather(*trickle)
    assert [103, 104, 105] in rec.batches
    await b.close()


async def test_bursty_arrivals_still_wait_for_company():
    rec = Recorder()
    b = Batcher("m", rec, BatchPolicy(max_queue_delay_s=0.2))
    await asyncio.gather(*(b.submit(i, sequences=1, length=1) for i in range(4)))  # a burst
    late = []

    async def trickle():
        for i in range(4, 7):
            late.append(asyncio.ensure_future(b.submit(i, sequences=1, length=1)))
            await asyncio.sleep(0.02)  # closer together than the delay

    await trickle()
    await asyncio.gather(*late)
    assert [4, 5, 6] in rec.batches  # the trickle was gathered into one batch
    await b.close()


async def test_a_closed_loop_client_does_not_wait_beside_traffic_of_another_key():
    """A decode stream (key "s") on a lane that also carries a steady trickle of stateless
    requests (key "a"): the trickle keeps batching, the stream's steps never wait for
    company, since no request of the trickle could share their batch, nor for the
    trickle's: a batch of "a" waiting for company stops waiting when a step queues."""
    rec = Recorder()
    b = Batcher("m", rec, BatchPolicy(max_queue_delay_s=0.3))
    stop = asyncio.Event()

    async def trickle() -> list:
        sent = []
        while not stop.is_set():  # about 10 per 0.3 s wait
            sent.append(asyncio.ensure_future(b.submit("a", sequences=1, length=1, key="a")))
            await asyncio.sleep(0.035)  # not a divisor of the delay: no phase lock
        return await asyncio.gather(*sent)

    burst = [b.submit("a", sequences=1, length=1, key="a") for _ in range(4)]
    await asyncio.gather(*burst)  # key "a" has had company: its batches wait for more
    task = asyncio.ensure_future(trickle())
    await asyncio.sleep(0.5)  # the trickle is under way and batching
    waits = []
    for _ in range(5):
        started = time.monotonic()
        await b.submit("s", sequences=1, length=1, key="s")
        waits.append(time.monotonic() - started)
    stop.set()
    await task
    # A step may wait for a batch of "a" to run (instant here), never for a 0.3 s delay.
    assert max(waits) < 0.2, f"steps waited {[round(w, 3) for w in waits]} s"
    trickle_sizes = [len(x) for x in rec.batches if x[0] == "a"]
    assert max(trickle_sizes) >= 5, f"the trickle ran as batches of {trickle_sizes}"
    assert all(x == ["s"] for x in rec.batches if "s" in x)  # keys never share a batch
    await b.close()


async def test_a_batch_waiting_for_company_lets_a_lone_request_of_another_key_go():
    rec = Recorder()
    b = Batcher("m", rec, BatchPolicy(max_queue_delay_s=0.5))
    await asyncio.gather(*(b.submit("a", sequences=1, length=1, key="a") for _ in range(4)))
    waiting = asyncio.ensure_future(b.submit("a", sequences=1, length=1, key="a"))
    await asyncio.sleep(0.05)  # that "a" now waits up to 0.5 s for company
    started = time.monotonic()
    await b.submit("s", sequences=1, length=1, key="s")  # a lone step: no company ever
    assert time.monotonic() - started < 0.3, "the step waited out the other key's delay"
    await waiting
    assert rec.batches[-2:] == [["a"], ["s"]]  # the waiting batch ran early, then the step
    await b.close()


async def test_a_long_steady_trickle_keeps_being_batched():
    """Open-loop arrivals closer together than the delay: those that come while a batch is
    forming join it, and count as company, so the lane keeps waiting for them round after
    round (they must not look like a lone client's)."""
    rec = Recorder()
    b = Batcher("m", rec, BatchPolicy(max_queue_delay_s=0.2))
    await asyncio.gather(*(b.submit(i, sequences=1, length=1) for i in range(4)))  # a burst
    trickle = []
    for i in range(4, 34):  # 30 arrivals 20 ms apart: about 10 per 0.2 s wait
        trickle.append(asyncio.ensure_future(b.submit(i, sequences=1, length=1)))
        await asyncio.sleep(0.02)
    await asyncio.gather(*trickle)
    sizes = [len(batch) for batch in rec.batches[1:]]
    assert sum(sizes) == 30 and len(sizes) <= 6, f"the trickle ran as batches of {sizes}"
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


async def b_queued_behind_a(shared) -> tuple:
    """Lanes a and b on one thread: a's batch holds it (its gate closed), b's item waits.
    Returns (a's gate, a, b, a's pending result, b's pending result)."""
    busy = Recorder()
    busy.gate.clear()
    a = Batcher("a", busy, policy(), executor=shared)
    b = Batcher("b", Recorder(), policy(), executor=shared)
    held = asyncio.ensure_future(a.submit(1, sequences=1, length=1))
    await wait_entered(busy)
    waiting = asyncio.ensure_future(b.submit(2, sequences=1, length=1))
    return busy.gate, a, b, held, waiting


async def test_time_waiting_for_a_shared_thread_counts_as_queue_not_compute():
    from concurrent.futures import ThreadPoolExecutor

    shared = ThreadPoolExecutor(max_workers=1)
    gate, a, b, held, waiting = await b_queued_behind_a(shared)
    await asyncio.sleep(0.3)  # b's batch waits behind a's on the one thread
    gate.set()
    (_, info) = await asyncio.wait_for(waiting, WAIT_S)
    assert info.queue_s >= 0.25 and info.compute_s < 0.25
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

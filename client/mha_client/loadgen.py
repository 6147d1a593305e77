"""Load generator: closed loop (N clients) or open loop (fixed rate) against any Target.

A Target answers request bytes with reply bytes, so the same generator measures mha-serve,
a naive gRPC server and a Ray Serve HTTP app (bench/). numpy only: no torch in the client.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np

from mha_client.channel import ChannelSecurity, open_channel
from mha_client.load_result import LoadResult, latency_stats
from mha_client.sdk import DEFAULT_MAX_MESSAGE_BYTES, build_attend_request, channel_options

GRPC_ATTEND_METHOD = "/mha.v1.AttentionService/Attend"
PROGRESS_TTY_S = 0.5  # a line redrawn in place on a terminal
PROGRESS_LOG_S = 5.0  # a new line when stderr is a file or pipe
PROGRESS_WINDOW = 2048  # latencies behind the live p50
# Open loop: arrivals beyond this many outstanding requests are skipped (and counted), so a
# server that cannot keep up makes the generator report it instead of exhausting memory.
DEFAULT_MAX_IN_FLIGHT = 4096
DEFAULT_TIMEOUT_S = 30.0
# Lengths drawn before the run (cycled), each one's request encoded before the clock starts.
NUM_LENGTH_DRAWS = 4096
# ...as many of those draws as their distinct requests fit in: "1..4096" drew ~2,600 lengths,
# 10 GiB of requests at embed_dim 512, all kept once sent.
PAYLOAD_BUDGET_BYTES = 1 << 30


class TargetError(Exception):
    """A request the target refused; `code` names the status, e.g. "RESOURCE_EXHAUSTED"."""

    def __init__(self, code: str, details: str = "") -> None:
        super().__init__(f"{code}: {details}" if details else code)
        self.code = code
        self.details = details


class Target(Protocol):
    """Anything that answers request bytes with reply bytes; raises TargetError on refusal."""

    async def send(self, payload: bytes, timeout: float | None) -> bytes: ...

    async def close(self) -> None: ...


class GrpcTarget:
    """A unary gRPC method called with pre-serialized bytes (mha.v1 Attend by default).

    No (de)serializers: requests are encoded once before the run and replies stay bytes, so
    the generator's own protobuf work does not count against the server it measures.
    security: TLS, mutual TLS and a bearer token, as for the SDK (None: plaintext); metadata:
    sent with every call (e.g. the Ray Serve application).
    """

    def __init__(
        self,
        address: str,
        *,
        method: str = GRPC_ATTEND_METHOD,
        channels: int = 1,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        security: ChannelSecurity | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        if channels < 1:
            raise ValueError(f"channels must be >= 1, got {channels}")
        self.address = address
        self._metadata = tuple(metadata or ()) or None
        # A local subchannel pool gives each channel its own TCP connection; by default
        # channels with equal arguments share one.
        opts = channel_options(max_message_bytes, [("grpc.use_local_subchannel_pool", 1)])
        self._channels = [
            open_channel(address, opts, aio=True, security=security) for _ in range(channels)
        ]
        self._calls = itertools.cycle([ch.unary_unary(method) for ch in self._channels])

    async def send(self, payload: bytes, timeout: float | None) -> bytes:
        try:
            return await next(self._calls)(payload, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise TargetError(err.code().name, err.details() or "") from None

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()


# ----- what to send


@dataclass(frozen=True)
class SeqLens:
    """Tokens per sequence: "16" (fixed), "8..64" (uniform, inclusive) or "16,32,128" (a list)."""

    kind: str  # "fixed" | "uniform" | "list"
    values: tuple[int, ...]  # fixed: (L,); uniform: (low, high); list: the choices

    def __post_init__(self) -> None:
        if any(v < 1 for v in self.values):
            raise ValueError(f"sequence lengths must be >= 1, got {self}")
        if self.kind == "uniform" and self.values[0] > self.values[1]:
            raise ValueError(f"uniform lengths {self} are empty: write LOW..HIGH with LOW <= HIGH")

    @property
    def max(self) -> int:
        return max(self.values)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "uniform":
            return rng.integers(self.values[0], self.values[1] + 1, size=n)
        return rng.choice(np.asarray(self.values), size=n)

    def __str__(self) -> str:
        if self.kind == "uniform":
            return f"{self.values[0]}..{self.values[1]}"
        return ",".join(str(v) for v in self.values)


def parse_seq_lens(text: str) -> SeqLens:
    """SeqLens from "16", "8..64" or "16,32,128"; ValueError with the accepted forms."""
    try:
        if ".." in text:
            low, high = text.split("..")
            return SeqLens("uniform", (int(low), int(high)))
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(
            f"{text!r} is not a sequence length: write 16 (fixed), 8..64 (uniform) or "
            f"16,32,128 (a list)"
        ) from None
    return SeqLens("fixed" if len(values) == 1 else "list", values)


@dataclass(frozen=True)
class Workload:
    """What every request carries: batch sequences of a length drawn from seq_lens."""

    model: str
    seq_lens: SeqLens
    embed_dim: int
    batch: int = 1
    weights: bool = False
    seed: int = 0


class Payloads:
    """Serialized AttendRequests, one per length, encoded on first use and then reused."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        rng = np.random.default_rng(workload.seed)
        shape = (workload.batch, workload.seq_lens.max, workload.embed_dim)
        self._x = rng.standard_normal(shape, dtype=np.float32)  # (B, Lmax, E)
        self._cache: dict[int, bytes] = {}

    def get(self, length: int) -> bytes:
        payload = self._cache.get(length)
        if payload is None:
            w = self.workload
            req = build_attend_request(w.model, self._x[:, :length], weights=w.weights)
            payload = self._cache[length] = req.SerializeToString()
        return payload


# ----- how to send it


@dataclass(frozen=True)
class LoadSpec:
    """Closed loop (concurrency) or open loop (rate), bounded by requests and/or duration.

    warmup requests go first and are left out of every statistic; duration_s counts from
    the first measured request.
    """

    concurrency: int | None = None
    rate: float | None = None  # requests per second
    arrivals: str = "poisson"  # open loop: "poisson" or "uniform" (evenly spaced)
    requests: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.arrivals not in ("poisson", "uniform"):
            raise ValueError(f"arrivals {self.arrivals!r}: choose poisson or uniform")
        if self.requests is None and self.duration_s is None:
            raise ValueError("unbounded load: give requests, duration_s or both")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"


def draw_lengths(workload: Workload, rng: np.random.Generator) -> np.ndarray:
    """The lengths a run cycles through: NUM_LENGTH_DRAWS draws of workload.seq_lens, cut
    where their distinct requests would pass PAYLOAD_BUDGET_BYTES (at least one draw), so
    that every request can be encoded, and kept, before the clock starts."""
    draws = workload.seq_lens.sample(rng, NUM_LENGTH_DRAWS)
    _, first = np.unique(draws, return_index=True)  # where each length is first drawn
    new_bytes = np.zeros(len(draws), dtype=np.int64)
    new_bytes[first] = draws[first] * workload.batch * workload.embed_dim * 4  # float32
    fits = int(np.searchsorted(np.cumsum(new_bytes), PAYLOAD_BUDGET_BYTES, side="right"))
    return draws[: max(1, fits)]


class _Run:
    """Shared state of one run: tickets, measured samples, and the stop rule."""

    def __init__(self, spec: LoadSpec, lengths: np.ndarray, batch: int) -> None:
        self.spec = spec
        self.lengths = lengths  # pre-drawn length of each request, cycled
        self.batch = batch
        self.issued = 0
        self.done = 0
        self.measure_start: float | None = None
        self.last_done = 0.0
        self.latencies: list[float] = []  # ms, successful measured requests
        self.tokens = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.error_messages: dict[str, str] = {}
        self.skipped = 0
        self.stopped = False

    def next_ticket(self, now: float) -> int | None:
        """Index of the next request, or None once the run's bounds are reached."""
        spec, i = self.spec, self.issued
        if self.stopped or (spec.requests is not None and i >= spec.warmup + spec.requests):
            self.stopped = True
            return None
        if i == spec.warmup:
            self.measure_start = now
        if (
            spec.duration_s is not None
            and self.measure_start is not None
            and now - self.measure_start >= spec.duration_s
        ):
            self.stopped = True
            return None
        self.issued += 1
        return i

    def length(self, ticket: int) -> int:
        return int(self.lengths[ticket % len(self.lengths)])

    def record(
        self, ticket: int, started: float, code: str | None, length: int, message: str = ""
    ) -> None:
        now = time.perf_counter()
        self.done += 1
        if ticket < self.spec.warmup:
            return
        self.last_done = now
        if code is None:
            self.latencies.append((now - started) * 1e3)
            self.tokens += self.batch * length
        else:
            self.errors[code] += 1
            self.error_messages.setdefault(code, message)


async def _send_one(
    target: Target, run: _Run, payloads: Payloads, ticket: int, started: float
) -> None:
    length = run.length(ticket)
    payload = payloads.get(length)
    code: str | None = None
    message = ""
    try:
        await target.send(payload, run.spec.timeout_s)
    except TargetError as err:
        code, message = err.code, err.details
    except TimeoutError:
        code = "CLIENT_TIMEOUT"
    except Exception as err:  # a broken target is reported, not fatal to the whole run
        code, message = type(err).__name__, str(err)
    run.record(ticket, started, code, length, message)


async def _closed_loop(target: Target, run: _Run, payloads: Payloads) -> None:
    async def client() -> None:
        while (ticket := run.next_ticket(time.perf_counter())) is not None:
            await _send_one(target, run, payloads, ticket, time.perf_counter())

    await asyncio.gather(*(client() for _ in range(run.spec.concurrency or 1)))


def _arrival_gaps(spec: LoadSpec) -> Callable[[], float]:
    """Seconds between consecutive arrivals: exponential (Poisson process) or constant."""
    mean = 1.0 / (spec.rate or 1.0)
    if spec.arrivals == "uniform":
        return lambda: mean
    rng = np.random.default_rng(spec.seed + 1)
    return lambda: float(rng.exponential(mean))


async def _open_loop(target: Target, run: _Run, payloads: Payloads) -> None:
    """Sends at scheduled times whatever is outstanding; latency counts from the scheduled
    time, so a late send (a busy generator) shows up as latency instead of hiding."""
    gap = _arrival_gaps(run.spec)
    tasks: set[asyncio.Task] = set()
    scheduled = time.perf_counter()
    try:
        while True:
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            ticket = run.next_ticket(scheduled)
            if ticket is None:
                break
            if len(tasks) >= run.spec.max_in_flight:
                run.done += 1
                if ticket >= run.spec.warmup:
                    run.skipped += 1
            else:
                task = asyncio.create_task(_send_one(target, run, payloads, ticket, scheduled))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            scheduled += gap()
        if tasks:
            await asyncio.gather(*tasks)
    finally:  # cancelled (Ctrl-C): no request outlives the run
        for task in list(tasks):
            task.cancel()


def _progress_line(run: _Run, started: float) -> str:
    elapsed = time.perf_counter() - started
    window = run.latencies[-PROGRESS_WINDOW:]
    p50 = f"{np.percentile(window, 50):.1f} ms" if window else "-"
    rate = 0.0
    if run.measure_start is not None and run.last_done > run.measure_start:
        rate = len(run.latencies) / (run.last_done - run.measure_start)  # ok, as the report
    phase = "warm-up" if run.measure_start is None else "measuring"
    errors = sum(run.errors.values())
    return (
        f"{phase} {elapsed:6.1f} s  sent {run.issued}  ok {len(run.latencies)}  "
        f"errors {errors}  {rate:8.1f} req/s  p50 {p50}"
    )


async def _report_progress(run: _Run, started: float, stream: Any) -> None:
    tty = getattr(stream, "isatty", lambda: False)()
    try:
        while True:
            await asyncio.sleep(PROGRESS_TTY_S if tty else PROGRESS_LOG_S)
            line = _progress_line(run, started)
            stream.write(f"\r{line}\x1b[K" if tty else line + "\n")
            stream.flush()
    except asyncio.CancelledError:
        if tty:
            stream.write("\r\x1b[K")
            stream.flush()
        raise


async def run_load(
    target: Target,
    workload: Workload,
    spec: LoadSpec,
    *,
    label: str = "",
    progress: Any | None = None,
    stop_on_interrupt: bool = False,
) -> LoadResult:
    """Runs the load described by spec and returns its statistics.

    progress: a stream (e.g. sys.stderr) for live progress, redrawn in place on a terminal
    and a line every PROGRESS_LOG_S seconds otherwise; None keeps quiet. stop_on_interrupt
    (the main thread only): SIGINT (Ctrl-C) ends the run, the requests in flight cancelled,
    and returns the statistics of those answered by then (interrupted=True); in another
    thread it is ignored (no loop but the main thread's takes signals).
    """
    rng = np.random.default_rng(spec.seed)
    payloads = Payloads(workload)
    run = _Run(spec, draw_lengths(workload, rng), workload.batch)
    for length in np.unique(run.lengths):  # every request it sends, before the clock starts
        payloads.get(int(length))
    cpu_start, started = time.process_time(), time.perf_counter()
    reporter = None
    if progress is not None:
        reporter = asyncio.create_task(_report_progress(run, started, progress))
    loop = _closed_loop if spec.mode == "closed" else _open_loop
    work = asyncio.ensure_future(loop(target, run, payloads))
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        work.cancel()

    # Only the main thread's loop can take a signal (a CLI run in a thread: Ctrl-C as ever)
    stop_on_interrupt = stop_on_interrupt and threading.current_thread() is threading.main_thread()
    if stop_on_interrupt:
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, interrupt)
    try:
        await work
    except asyncio.CancelledError:
        if not interrupted:
            raise
    finally:
        if stop_on_interrupt:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
        if reporter is not None:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)
    cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - started
    elapsed = run.last_done - run.measure_start if run.measure_start is not None else 0.0
    ok = len(run.latencies)
    per_s = (lambda n: n / elapsed) if elapsed > 0 else (lambda n: 0.0)
    return LoadResult(
        mode=spec.mode,
        label=label,
        model=workload.model,
        seq_lens=str(workload.seq_lens),
        batch=workload.batch,
        weights=workload.weights,
        concurrency=spec.concurrency,
        rate=spec.rate,
        arrivals=spec.arrivals if spec.mode == "open" else None,
        warmup=spec.warmup,
        ok=ok,
        errors=dict(run.errors),
        error_messages=run.error_messages,
        skipped=run.skipped,
        elapsed_s=elapsed,
        requests_per_s=per_s(ok),
        sequences_per_s=per_s(ok * workload.batch),
        tokens_per_s=per_s(run.tokens),
        latency=latency_stats(run.latencies),
        client_cpu_s=cpu_s,
        client_wall_s=wall_s,
        interrupted=interrupted,
    )


def run_load_sync(
    target_factory: Callable[[], Target], workload: Workload, spec: LoadSpec, **kw: Any
) -> LoadResult:
    """run_load in a fresh event loop; the target is made (and closed) inside that loop."""

    async def main() -> LoadResult:
        target = target_factory()
        try:
            return await run_load(target, workload, spec, **kw)
        finally:
            await target.close()

    return asyncio.run(main())

"""Load generator: closed loop (N clients) or open loop (fixed rate) against any Target.

A Target answers request bytes with reply bytes, so the same generator measures mha-serve,
a naive gRPC server and a Ray Serve HTTP app (bench/). numpy only: no torch in the client.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np

from mha_client.channel import ChannelSecurity, open_channel
from mha_client.cli_types import (
    UsageError,
    fraction,
    non_negative_int,
    positive_float,
    positive_int,
)
from mha_client.sdk import DEFAULT_MAX_MESSAGE_BYTES, build_attend_request, channel_options

GRPC_ATTEND_METHOD = "/mha.v1.AttentionService/Attend"
PERCENTILES = (50, 95, 99)
PROGRESS_TTY_S = 0.5  # a line redrawn in place on a terminal
PROGRESS_LOG_S = 5.0  # a new line when stderr is a file or pipe
PROGRESS_WINDOW = 2048  # latencies behind the live p50
# Open loop: arrivals beyond this many outstanding requests are skipped (and counted), so a
# server that cannot keep up makes the generator report it instead of exhausting memory.
DEFAULT_MAX_IN_FLIGHT = 4096
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CLI_DURATION_S = 10.0  # `mha-client load` with neither --requests nor --duration
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped
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


@dataclass
class LatencyStats:
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


def latency_stats(latencies_ms: Sequence[float]) -> LatencyStats:
    """Mean, p50/p95/p99 (linear interpolation between order statistics) and max; NaN if empty."""
    lat = np.asarray(latencies_ms, dtype=np.float64)
    if lat.size == 0:
        return LatencyStats(0, *([math.nan] * 5))
    p50, p95, p99 = np.percentile(lat, PERCENTILES)
    mean, peak = float(lat.mean()), float(lat.max())
    return LatencyStats(int(lat.size), mean, float(p50), float(p95), float(p99), peak)


@dataclass
class LoadResult:
    mode: str
    label: str
    model: str
    seq_lens: str
    batch: int
    weights: bool
    concurrency: int | None
    rate: float | None
    arrivals: str | None
    warmup: int
    ok: int  # measured requests that succeeded
    errors: dict[str, int]  # measured failures by status code
    error_messages: dict[str, str]  # the first measured failure's message of each code
    skipped: int  # open loop: arrivals dropped at max_in_flight
    elapsed_s: float  # first measured request sent -> last measured reply
    requests_per_s: float  # successful requests only
    sequences_per_s: float
    tokens_per_s: float  # real tokens (batch x length) of successful requests
    latency: LatencyStats
    client_cpu_s: float  # CPU time of the generator's process over the whole run
    # Wall time of that same whole run (warm-up included): the span client_cpu_s is spent
    # in, so client_cpu_s / client_wall_s is the cores the generator kept busy. elapsed_s,
    # the measured window alone, is shorter: CPU divided by it could exceed the machine.
    client_wall_s: float
    interrupted: bool = False  # stopped by Ctrl-C: the figures are of what answered by then
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The fields, JSON-ready: JSON has no NaN, so the latency of no answer is null."""
        d = asdict(self)
        d["latency"] = {k: v if math.isfinite(v) else None for k, v in d["latency"].items()}
        return d

    @property
    def error_rate(self) -> float:
        """The fraction of the measured requests that failed (arrivals skipped at
        max_in_flight were never sent: not counted)."""
        failed = sum(self.errors.values())
        return failed / (failed + self.ok) if failed + self.ok else 0.0

    @property
    def client_cores(self) -> float:
        """Cores the generator's process kept busy on average over its run."""
        return self.client_cpu_s / self.client_wall_s if self.client_wall_s > 0 else 0.0

    def format(self) -> str:
        loop = (
            f"closed loop, {self.concurrency} clients"
            if self.mode == "closed"
            else f"open loop, {self.rate:g} req/s {self.arrivals}"
        )
        head = f"{self.label + ': ' if self.label else ''}{loop}; model {self.model}, "
        head += f"seq_len {self.seq_lens}, batch {self.batch}{', weights' if self.weights else ''}"
        lat = self.latency
        errors = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        if self.skipped:
            errors += f"; {self.skipped} arrivals skipped (over max_in_flight)"
        stopped = "; stopped by Ctrl-C" if self.interrupted else ""
        # What a refusal says (a limit, what to change): the counts alone do not tell it.
        errors += "".join(
            f"\n             first {k}: {m}" for k, m in sorted(self.error_messages.items()) if m
        )
        return "\n".join(
            [
                head,
                f"requests     {self.ok} ok in {self.elapsed_s:.2f} s "
                f"(warm-up {self.warmup} excluded{stopped})",
                f"throughput   {self.requests_per_s:.1f} req/s  {self.sequences_per_s:.1f} seq/s  "
                f"{self.tokens_per_s:.0f} tokens/s",
                f"latency ms   p50 {lat.p50_ms:.2f}  p95 {lat.p95_ms:.2f}  p99 {lat.p99_ms:.2f}  "
                f"max {lat.max_ms:.2f}  mean {lat.mean_ms:.2f}",
                f"errors       {errors}",
                f"client cpu   {self.client_cpu_s:.3f} s in {self.client_wall_s:.3f} s, "
                f"warm-up included ({self.client_cores:.2f} cores)",
            ]
        )


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


# ----- `mha-client load` (the parser and command live here; cli.py only registers them)


def _seq_lens_arg(text: str) -> SeqLens:
    try:
        return parse_seq_lens(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _rate_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of requests/s")
    return value


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model name, as `mha-client models` lists")
    loop = p.add_mutually_exclusive_group()
    loop.add_argument("--concurrency", type=positive_int, help="closed loop: N clients (default 1)")
    loop.add_argument("--rate", type=_rate_arg, help="open loop: requests per second")
    p.add_argument(
        "--arrivals",
        choices=["poisson", "uniform"],
        help="open-loop (--rate) arrival process (default poisson)",
    )
    p.add_argument("--requests", type=positive_int, help="measured requests (after warm-up)")
    p.add_argument(
        "--duration",
        type=positive_float,
        metavar="SECONDS",
        help=f"measured seconds (default {DEFAULT_CLI_DURATION_S:g} without --requests)",
    )
    p.add_argument(
        "--seq-len",
        type=_seq_lens_arg,
        default=parse_seq_lens("16"),
        help="16 (fixed), 8..64 (uniform) or 16,32,128 (a list); default 16",
    )
    p.add_argument(
        "--batch", type=positive_int, default=1, help="sequences per request (default 1)"
    )
    p.add_argument("--weights", action="store_true", help="ask for attention weights too")
    p.add_argument(
        "--channels",
        type=positive_int,
        default=1,
        help="TCP connections the clients share, taken in turn (default 1); a server with "
        "--frontend-workers N spreads connections, not calls, over its frontends: give N or more",
    )
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        default=20,
        help="requests sent first and left out of the stats (default 20)",
    )
    p.add_argument(
        "--max-error-rate",
        type=fraction,
        default=0.0,
        metavar="FRACTION",
        help="exit 1 when more than this fraction of the measured requests failed "
        "(default 0: any failure; 1: never, e.g. when overload refusals are expected)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, metavar="FILE.json", help="write the results here")


def cmd_load(client: Any, args: argparse.Namespace) -> int:
    """Runs the load against args.target with the model's embed_dim; prints the summary.
    Its channels are secured as the CLI's client is (the same --tls, --ca-file, --cert-file,
    --key-file, --token-file and --application)."""
    if args.arrivals is not None and args.rate is None:
        raise UsageError("--arrivals shapes the open loop's arrivals: give --rate with it")
    embed_dim = client.model_info(args.model).embed_dim
    workload = Workload(args.model, args.seq_len, embed_dim, args.batch, args.weights, args.seed)
    duration = args.duration
    if duration is None and args.requests is None:
        duration = DEFAULT_CLI_DURATION_S
    spec = LoadSpec(
        concurrency=None if args.rate is not None else (args.concurrency or 1),
        rate=args.rate,
        arrivals=args.arrivals or "poisson",
        requests=args.requests,
        duration_s=duration,
        warmup=args.warmup,
        timeout_s=args.timeout,
        seed=args.seed,
    )
    target, security, metadata = args.target, client.security, client.metadata
    result = run_load_sync(
        lambda: GrpcTarget(target, channels=args.channels, security=security, metadata=metadata),
        workload,
        spec,
        label=target,
        progress=sys.stderr,
        stop_on_interrupt=True,
    )
    print(result.format())
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if result.interrupted:
        return EXIT_INTERRUPTED
    if result.ok == 0:
        return 1  # nothing answered: not a measurement
    if result.error_rate > args.max_error_rate:
        failed = sum(result.errors.values())
        print(
            f"mha-client load: {failed} of {failed + result.ok} measured requests failed "
            f"({result.error_rate:.1%}), over --max-error-rate {args.max_error_rate:g}",
            file=sys.stderr,
        )
        return 1
    return 0

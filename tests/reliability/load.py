"""Load for the reliability tests: raw Attend calls with pre-serialized requests (the
client's own protobuf work stays out of the way), each call's status and latency kept, and
the server's /metrics read back."""

from __future__ import annotations

import asyncio
import collections
import re
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
import numpy as np

from mha_client.api import attention_pb2 as pb

ATTEND = "/mha.v1.AttentionService/Attend"
MAX_MESSAGES = 10


def attend_bytes(
    model: str, batch: int, seq_len: int, embed_dim: int = 512, seed: int = 0
) -> bytes:
    x = np.random.default_rng(seed).standard_normal((batch, seq_len, embed_dim), dtype=np.float32)
    tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())
    return pb.AttendRequest(model=model, input=tensor).SerializeToString()


@dataclass
class Outcomes:
    """Status and latency (ms) of every call."""

    codes: collections.Counter = field(default_factory=collections.Counter)
    latency_ms: dict[str, list[float]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    # distinct messages per status (the first MAX_MESSAGES)
    details: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))

    @property
    def sent(self) -> int:
        return sum(self.codes.values())

    def add(self, code: grpc.StatusCode, ms: float, details: str = "") -> None:
        self.codes[code.name] += 1
        self.latency_ms[code.name].append(ms)
        if details and len(self.details[code.name]) < MAX_MESSAGES:
            self.details[code.name].add(details)

    def p(self, code: str, q: float) -> float:
        values = self.latency_ms.get(code)
        return float(np.percentile(values, q)) if values else float("nan")

    def summary(self) -> str:
        parts = [
            f"{code} {n} (p50 {self.p(code, 50):.1f} ms, p99 {self.p(code, 99):.1f} ms)"
            for code, n in sorted(self.codes.items())
        ]
        return f"{self.sent} sent: " + ", ".join(parts)


async def call(method, payload: bytes, timeout: float, out: Outcomes) -> None:
    start = time.perf_counter()
    try:
        await method(payload, timeout=timeout)
        out.add(grpc.StatusCode.OK, (time.perf_counter() - start) * 1e3)
    except grpc.aio.AioRpcError as e:
        out.add(e.code(), (time.perf_counter() - start) * 1e3, e.details() or "")


def channels(target: str, n: int) -> list[grpc.aio.Channel]:
    options = [
        ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
    ]
    return [grpc.aio.insecure_channel(target, options=options) for _ in range(n)]


async def closed_loop(
    target: str, payload: bytes, *, concurrency: int, requests: int, timeout: float = 60.0
) -> tuple[Outcomes, float]:
    """`concurrency` clients, each sending its next request when the last is answered;
    returns the outcomes and the seconds the whole run took."""
    chans = channels(target, min(concurrency, 4))
    methods = [c.unary_unary(ATTEND) for c in chans]
    out, left = Outcomes(), [requests]

    async def client(i: int) -> None:
        while left[0] > 0:
            left[0] -= 1
            await call(methods[i % len(methods)], payload, timeout, out)

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    for c in chans:
        await c.close()
    return out, elapsed


async def open_loop(
    target: str, payload: bytes, *, rate: float, requests: int, timeout: float = 60.0
) -> tuple[Outcomes, float]:
    """Arrivals evenly spaced at `rate` per second whatever the answers (a client that does
    not slow down when the server does); returns the outcomes and the run's seconds."""
    chans = channels(target, 4)
    methods = [c.unary_unary(ATTEND) for c in chans]
    out, tasks = Outcomes(), []
    start = time.perf_counter()
    for i in range(requests):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(call(methods[i % 4], payload, timeout, out)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    for c in chans:
        await c.close()
    return out, elapsed


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(metrics_port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """Every sample of /metrics: 'name{labels}' -> value."""
    text = urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=10).read()
    samples = {}
    for line in text.decode().splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def requests_total(samples: dict[str, float], method: str, code: str) -> float:
    return sum(
        v
        for k, v in samples.items()
        if k.startswith("mha_serve_requests_total{")
        and f'method="{method}"' in k
        and f'code="{code}"' in k
    )

"""A client's sessions under random operations, every step checked against its full causal
recompute (raw mha.v1 stubs: what tests/ray_app checks is the routing, whatever the SDK's
shape). Shared by the affinity and scale tests."""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request
from collections.abc import Iterator

import numpy as np

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.tensors import from_proto, to_proto
from mha_serve.ray_app.ids import replica_of
from tests.ray_app.conftest import ATOL

MODELS = ("mha", "gqa", "mqa")
EMBED = 512
TIMEOUT_S = 120.0


class Driver:
    """One client's sessions, each with the tokens it should hold (raw mha.v1 stubs: what
    is tested here is the routing, whatever the SDK's shape)."""

    def __init__(self, stub: pb_grpc.AttentionServiceStub, models, seed: int) -> None:
        self.stub, self.models = stub, models
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.model = MODELS[seed % len(MODELS)]
        self.sessions: dict[str, np.ndarray] = {}  # id -> the tokens it holds
        self.replicas: set[str] = set()

    def tokens(self, n: int) -> np.ndarray:
        return self.np.standard_normal((n, EMBED), dtype=np.float32)

    def step_request(self, sid: str, x: np.ndarray) -> pb.AttendRequest:
        return pb.AttendRequest(session_id=sid, input=to_proto(x))

    def check(self, sid: str, x: np.ndarray, reply: pb.AttendResponse) -> None:
        history = np.concatenate([self.sessions[sid], x])
        want = self.models.step(self.model, history, len(x))
        got = from_proto(reply.output).reshape(want.shape)
        np.testing.assert_allclose(got, want, atol=ATOL, err_msg=f"session {sid}")
        self.sessions[sid] = history

    async def create(self) -> str:
        info = await self.stub.CreateSession(
            pb.CreateSessionRequest(model=self.model), timeout=TIMEOUT_S
        )
        self.sessions[info.session_id] = np.zeros((0, EMBED), np.float32)
        self.replicas.add(replica_of(info.session_id))
        return info.session_id

    async def run(self, num_ops: int) -> None:
        """num_ops random operations on this driver's sessions (forks add sessions)."""
        for _ in range(num_ops):
            sid = self.rng.choice(sorted(self.sessions))
            op = self.rng.random()
            if op < 0.4:
                x = self.tokens(self.rng.randint(1, 4))
                self.check(
                    sid, x, await self.stub.Attend(self.step_request(sid, x), timeout=TIMEOUT_S)
                )
            elif op < 0.75:
                xs = [self.tokens(1) for _ in range(self.rng.randint(1, 3))]
                requests = [self.step_request(sid if i == 0 else "", x) for i, x in enumerate(xs)]
                replies = self.stub.StreamSession(iter(requests), timeout=TIMEOUT_S)
                for x, reply in zip(xs, [r async for r in replies], strict=True):
                    self.check(sid, x, reply)
            elif op < 0.9 and len(self.sessions) < 3:
                child = await self.stub.ForkSession(
                    pb.ForkSessionRequest(session_id=sid), timeout=TIMEOUT_S
                )
                assert replica_of(child.session_id) == replica_of(sid)  # it shares sid's blocks
                self.sessions[child.session_id] = self.sessions[sid].copy()
            else:
                keep = self.rng.randint(0, len(self.sessions[sid]))
                request = pb.TruncateSessionRequest(session_id=sid, num_tokens=keep)
                assert (
                    await self.stub.TruncateSession(request, timeout=TIMEOUT_S)
                ).num_tokens == keep
                self.sessions[sid] = self.sessions[sid][:keep]
            await asyncio.sleep(0)

    async def close(self) -> None:
        for sid in self.sessions:
            await self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=TIMEOUT_S)
        self.sessions.clear()


def replica_metrics(ports) -> Iterator[str]:
    """The /metrics text of each replica whose port answers (a replica's is the app's
    metrics_port plus its local rank on the node; a redeploy's new replicas start at the
    ranks after the old ones', renumbered once those stopped)."""
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                yield r.read().decode()
        except OSError:
            continue


def wait_metrics_on_first_ports(ports: tuple[int, ...], replicas: set[str]) -> None:
    """Until the replicas' /metrics answer on the first len(replicas) ports, one each, and
    no other port answers (Ray renumbers a node's replicas once others there stopped)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        served = {}
        for port in ports:
            text = next(replica_metrics([port]), "")
            found = re.search(r'replica="([^"]+)"', text)
            served[port] = found.group(1) if found else None
        first = [served[p] for p in ports[: len(replicas)]]
        if set(first) == replicas and not any(served[p] for p in ports[len(replicas) :]):
            return
        assert time.monotonic() < deadline, f"{served} after {TIMEOUT_S} s ({replicas})"
        time.sleep(0.2)

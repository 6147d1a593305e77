"""Sessions stepped from threads while Ray stops replicas (scale-down, redeploy), every
step checked against the full causal recompute of the session's tokens. A stream that its
stopping replica ends (UNAVAILABLE, saying to reopen) is reopened with the messages that
got no reply; any other error is kept and fails the test. Shared by test_scale and
test_redeploy."""

from __future__ import annotations

import functools
import queue
import random
import threading
from collections.abc import Callable
from typing import TypeVar

import grpc
import numpy as np

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.tensors import from_proto, to_proto
from mha_serve.ray_app.ids import replica_of
from tests.ray_app.conftest import ATOL
from tests.ray_app.drivers import EMBED, MODELS, TIMEOUT_S, replica_metrics

T = TypeVar("T")
MAX_STEPS = 400  # per thread: the loop's bound, whatever Ray takes
MAX_REOPENS = 20  # per stream


class Stepper:
    """One thread's sessions: (id, model) -> the tokens it holds."""

    def __init__(self, stub: pb_grpc.AttentionServiceStub, models, seed: int, metadata=()):
        self.stub, self.models, self.metadata = stub, models, tuple(metadata)
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.sessions: dict[str, tuple[str, np.ndarray]] = {}
        self.steps = 0
        self.reopened = 0
        self.error: BaseException | None = None
        self.stepped = threading.Event()  # set after its first step

    def create(self, model: str) -> str:
        info = self.stub.CreateSession(
            pb.CreateSessionRequest(model=model), timeout=TIMEOUT_S, metadata=self.metadata
        )
        self.sessions[info.session_id] = (model, np.zeros((0, EMBED), np.float32))
        return info.session_id

    def tokens(self, n: int) -> np.ndarray:
        return self.np.standard_normal((n, EMBED), dtype=np.float32)

    def check(self, sid: str, x: np.ndarray, reply: pb.AttendResponse) -> None:
        model, held = self.sessions[sid]
        history = np.concatenate([held, x])
        want = self.models.step(model, history, len(x))
        got = from_proto(reply.output).reshape(want.shape)
        np.testing.assert_allclose(got, want, atol=ATOL, err_msg=f"session {sid}")
        self.sessions[sid] = (model, history)

    def step(self, sid: str) -> None:
        """One unary step or one stream of 1-3 steps, at random."""
        if self.rng.random() < 0.5:
            x = self.tokens(self.rng.randint(1, 3))
            request = pb.AttendRequest(session_id=sid, input=to_proto(x))
            reply = self.stub.Attend(request, timeout=TIMEOUT_S, metadata=self.metadata)
            self.check(sid, x, reply)
        else:
            self.stream(sid, [self.tokens(1) for _ in range(self.rng.randint(1, 3))])
        self.steps += 1
        self.stepped.set()

    def stream(self, sid: str, xs: list[np.ndarray]) -> None:
        for _ in range(MAX_REOPENS):
            requests = [
                pb.AttendRequest(session_id=sid if i == 0 else "", input=to_proto(x))
                for i, x in enumerate(xs)
            ]
            replies = self.stub.StreamSession(
                iter(requests), timeout=TIMEOUT_S, metadata=self.metadata
            )
            try:
                for reply in replies:
                    self.check(sid, xs.pop(0), reply)
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or "reopen" not in e.details():
                    raise
                self.reopened += 1  # its replica is stopping: the rest go again
        raise AssertionError(f"session {sid}: stream reopened {MAX_REOPENS} times")

    def run(self, go_on: Callable[[], bool]) -> None:
        """Steps its sessions in random order while go_on(); keeps the first error."""
        try:
            for _ in range(MAX_STEPS):
                if not go_on():
                    return
                self.step(self.rng.choice(sorted(self.sessions)))
            raise AssertionError(f"still stepping after {MAX_STEPS} steps")
        except BaseException as e:  # noqa: BLE001 (reported by the test's thread)
            self.error = e
            self.stepped.set()

    def held(self) -> None:
        """Every session still there (GetSession through its router) with its tokens."""
        for sid, (_, history) in self.sessions.items():
            info = self.stub.GetSession(
                pb.GetSessionRequest(session_id=sid), timeout=TIMEOUT_S, metadata=self.metadata
            )
            assert info.num_tokens == len(history), (sid, info.num_tokens, len(history))

    def close(self) -> None:
        for sid in self.sessions:
            self.stub.CloseSession(
                pb.CloseSessionRequest(session_id=sid), timeout=TIMEOUT_S, metadata=self.metadata
            )
        self.sessions.clear()


class OpenStream:
    """A StreamSession held open between its messages (a client between decode steps)."""

    def __init__(self, stepper: Stepper, sid: str) -> None:
        self.stepper, self.sid = stepper, sid
        self._outbox: queue.Queue = queue.Queue()
        first = True

        def requests():
            nonlocal first
            while (x := self._outbox.get()) is not None:
                yield pb.AttendRequest(session_id=sid if first else "", input=to_proto(x))
                first = False

        self._replies = stepper.stub.StreamSession(
            requests(), timeout=TIMEOUT_S, metadata=stepper.metadata
        )

    def step(self) -> None:
        x = self.stepper.tokens(1)
        self._outbox.put(x)
        self.stepper.check(self.sid, x, next(self._replies))

    def ended(self) -> grpc.RpcError | None:
        """Waits for the stream's end without sending more: its error, or None."""
        try:
            next(self._replies)
        except grpc.RpcError as e:
            self._outbox.put(None)  # (lets the request thread go)
            return e
        raise AssertionError(f"session {self.sid}: a reply to no message")

    def close(self) -> None:
        self._outbox.put(None)
        assert list(self._replies) == []


def stepping_through(steppers: list[Stepper], change: Callable[[], T], steps_after: int) -> T:
    """change() (a scale-down, a redeploy) while every stepper steps its sessions on a
    thread of its own: each has stepped before it begins, and each steps `steps_after`
    more once it is done; the first error of any stepper is raised here."""
    done = threading.Event()
    steps_then: dict[int, int] = {}

    def go_on(st: Stepper) -> bool:
        if not done.is_set():
            return True
        steps_then.setdefault(id(st), st.steps)
        return st.steps - steps_then[id(st)] < steps_after

    threads = [
        threading.Thread(target=st.run, args=(functools.partial(go_on, st),)) for st in steppers
    ]
    for t in threads:
        t.start()
    for st in steppers:
        assert st.stepped.wait(TIMEOUT_S)
    try:
        result = change()
    finally:
        done.set()
        for t in threads:
            t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    for st in steppers:
        if st.error is not None:
            raise st.error
    return result


def spread_sessions(
    steppers: list[Stepper], per_stepper: int, replicas: set[str], max_tries: int = 200
) -> None:
    """per_stepper sessions for each stepper (models in turn), together on every replica of
    `replicas` (sessions land by load: extra ones are made and closed until they do)."""
    made = 0
    while True:
        where = {replica_of(s) for st in steppers for s in st.sessions}
        full = all(len(st.sessions) >= per_stepper for st in steppers)
        if full and where >= replicas:
            return
        assert made < max_tries, f"sessions on {where} after {made} tries, not {replicas}"
        st = steppers[made % len(steppers)]
        if len(st.sessions) >= per_stepper:  # replace its most crowded replica's newest
            counts: dict[str, int] = {}
            for s in st.sessions:
                counts[replica_of(s)] = counts.get(replica_of(s), 0) + 1
            crowded = max(counts, key=counts.get)
            sid = [s for s in st.sessions if replica_of(s) == crowded][-1]
            st.stub.CloseSession(
                pb.CloseSessionRequest(session_id=sid), timeout=TIMEOUT_S, metadata=st.metadata
            )
            del st.sessions[sid]
        st.create(MODELS[made % len(MODELS)])
        made += 1


def metric_sum(ports, name: str, labels: str = "") -> float:
    """The sum of a counter over the replicas whose /metrics answer on `ports`."""
    total = 0.0
    for text in replica_metrics(ports):
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                total += float(line.rsplit(" ", 1)[1])
    return total

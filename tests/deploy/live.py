"""A real Prometheus and real gRPC traffic on loopback, for tests/deploy/test_real_prometheus.py."""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import yaml

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from tests.deploy.sources import RULES
from tests.helpers import free_port

SCRAPE_INTERVAL = "1s"
READY_TIMEOUT_S = 30.0
EMBED = 64  # the models' embed_dim in the test's config


# --- Prometheus -------------------------------------------------------------------------


class Prometheus:
    """Debian's prometheus on 127.0.0.1, scraping one target every second, with our rules."""

    def __init__(self, exe: str, target: str, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "mha-serve", "static_configs": [{"targets": [target]}]}
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                exe,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log()}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {READY_TIMEOUT_S} s:\n{self.log()}")

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400 for a query that does not parse
            body = json.load(e)
        assert body["status"] == "success", f"{path} {params}: {body.get('error')}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# --- traffic ----------------------------------------------------------------------------


def tensor(x: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())


class Traffic:
    """A few client threads over one channel each: bounded in time, stopped by stop()."""

    def __init__(self, target: str, seconds: float) -> None:
        self.target = target
        self.until = time.monotonic() + seconds
        self.stopped = threading.Event()
        self.codes: dict[str, int] = {}
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(work,), daemon=True)
            for work in (self._stateless, self._stateless, self._sessions, self._faults)
        ]

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(30)

    def running(self) -> bool:
        return not self.stopped.is_set() and time.monotonic() < self.until

    def _count(self, code: grpc.StatusCode) -> None:
        with self._lock:
            self.codes[code.name] = self.codes.get(code.name, 0) + 1

    def _call(self, method, request, **kw):
        try:
            reply = method(request, timeout=30, **kw)
            self._count(grpc.StatusCode.OK)
            return reply
        except grpc.RpcError as e:
            self._count(e.code())
            return None

    def _run(self, work) -> None:
        try:
            with grpc.insecure_channel(self.target) as channel:
                work(pb_grpc.AttentionServiceStub(channel), np.random.default_rng(len(self.codes)))
        except BaseException as e:  # reported by the test, not lost in a thread
            self.errors.append(e)

    def _stateless(self, stub, rng) -> None:
        i = 0
        while self.running():
            i += 1
            model = ("mha", "gqa")[i % 2]
            # the load rises and falls, so that the panels show some shape
            phase = math.sin(time.monotonic() / 4)
            batch, seq = int(rng.integers(1, 4)), int(rng.integers(8, 64 if phase > 0 else 24))
            x = rng.standard_normal((batch, seq, EMBED)).astype(np.float32)
            weights = pb.WeightsRequest(enabled=True, heads=[0, 1]) if i % 5 == 0 else None
            self._call(stub.Attend, pb.AttendRequest(model=model, input=tensor(x), weights=weights))
            time.sleep(0.01 if phase > 0 else 0.04)

    def _sessions(self, stub, rng) -> None:
        # One gqa session holds the whole of gqa's small cache for the run.
        full = self._call(stub.CreateSession, pb.CreateSessionRequest(model="gqa"))
        x = rng.standard_normal((64, EMBED)).astype(np.float32) * 0.1
        self._call(stub.Attend, pb.AttendRequest(session_id=full.session_id, input=tensor(x)))
        open_ids: list[str] = []
        while self.running():
            sid = self._call(stub.CreateSession, pb.CreateSessionRequest(model="mha")).session_id
            open_ids.append(sid)
            steps = [
                pb.AttendRequest(
                    session_id=sid,
                    input=tensor(rng.standard_normal((8, EMBED)).astype(np.float32) * 0.1),
                    weights=pb.WeightsRequest(enabled=n == 2),
                )
                for n in range(3)
            ]
            try:
                for _ in stub.StreamSession(iter(steps), timeout=30):
                    self._count(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                self._count(e.code())
            # Between 2 and 8 sessions (2 blocks each) stay open as the load rises and falls.
            keep = 2 if math.sin(time.monotonic() / 4) < 0 else 8
            while len(open_ids) > keep:
                self._call(stub.CloseSession, pb.CloseSessionRequest(session_id=open_ids.pop(0)))
            time.sleep(0.05)
        for sid in [*open_ids, full.session_id]:
            self._call(stub.CloseSession, pb.CloseSessionRequest(session_id=sid))

    def _faults(self, stub, rng) -> None:
        x = rng.standard_normal((1, 8, EMBED)).astype(np.float32)
        while self.running():
            # NOT_FOUND: no such model
            self._call(stub.Attend, pb.AttendRequest(model="no-such", input=tensor(x)))
            # INVALID_ARGUMENT: the wrong embedding width
            bad = rng.standard_normal((1, 8, EMBED + 1)).astype(np.float32)
            self._call(stub.Attend, pb.AttendRequest(model="mha", input=tensor(bad)))
            # RESOURCE_EXHAUSTED: gqa's cache is full
            sid = self._call(stub.CreateSession, pb.CreateSessionRequest(model="gqa"))
            if sid is not None:
                step = pb.AttendRequest(session_id=sid.session_id, input=tensor(x[0] * 0.1))
                self._call(stub.Attend, step)
                self._call(stub.CloseSession, pb.CloseSessionRequest(session_id=sid.session_id))
            time.sleep(0.2)

"""BASELINE, not mha-serve: the Ray Serve app a user of the stack would write instead.

One deployment holding the same module and seeded weights, `@serve.batch` around it (pad to
the longest, stack, one forward, split), behind Ray Serve's HTTP proxy. The body is the same
bytes as mha-serve's gRPC call: a serialized mha.v1 AttendRequest in, AttendResponse out.
HTTP rather than Ray's gRPC proxy: that proxy binds [::] with no host option, and these
benchmarks listen on loopback only.

    python bench/ray_baseline.py --port 0    # prints "listening on http://127.0.0.1:PORT/"
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from typing import Any

from mha_client.loadgen import TargetError

# @serve.batch settings, matched to mha-serve's defaults (service/batching/batcher.py) so
# both batch the same way; Ray's own default max_ongoing_requests (5) would cap batches at 5.
MAX_BATCH_SIZE = 64
BATCH_WAIT_TIMEOUT_S = 0.002
MAX_ONGOING_REQUESTS = 256
NUM_CPUS = 2  # the replica gets the machine's 2 cores (Ray sets OMP threads from this)
# Ray Serve logs a line per request by default; a user measuring throughput turns that off.
LOGGING = {"enable_access_log": False, "log_level": "WARNING"}


def build_app(model: str = "mha") -> Any:
    """The Ray Serve application; imports Ray, torch and the module only when called."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(
        num_replicas=1,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": NUM_CPUS},
        logging_config=LOGGING,
    )
    class RayAttention:
        def __init__(self, model: str) -> None:
            import torch

            from mha_serve.config import default_models
            from mha_serve.model import MultiHeadAttention, init_weights

            spec = {s.name: s for s in default_models()}[model]
            self.torch, self.model = torch, model
            self.module = MultiHeadAttention(spec.attention)
            init_weights(self.module, spec.seed)
            self.module.eval()
            self.embed_dim = spec.attention.embed_dim

        @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_TIMEOUT_S)
        async def forward(self, xs: list[Any]) -> list[Any]:
            torch = self.torch
            longest = max(x.shape[1] for x in xs)
            lengths = [x.shape[1] for x in xs for _ in range(x.shape[0])]
            batch = torch.zeros(len(lengths), longest, self.embed_dim)  # (N, Lmax, E)
            row = 0
            for x in xs:
                batch[row : row + x.shape[0], : x.shape[1]] = x
                row += x.shape[0]
            padded = torch.tensor(lengths) if min(lengths) < longest else None
            with torch.inference_mode():
                out = self.module(batch, lengths=padded).output  # (N, Lmax, E)
            results, row = [], 0
            for x in xs:
                results.append((out[row : row + x.shape[0], : x.shape[1]].numpy(), len(lengths)))
                row += x.shape[0]
            return results

        async def __call__(self, request: Request) -> Response:
            from mha_client.api import attention_pb2 as pb

            req = pb.AttendRequest.FromString(await request.body())
            if req.model != self.model or req.input.dtype != pb.DTYPE_FLOAT32 or req.lengths:
                return Response(b"the baseline serves float32 full-length inputs", 400)
            shape = list(req.input.shape)
            x = self.torch.frombuffer(bytearray(req.input.data), dtype=self.torch.float32)
            x = x.view([1, *shape] if len(shape) == 2 else shape)  # (B, L, E)
            out, batch_size = await self.forward(x)
            resp = pb.AttendResponse(
                model=req.model,
                output=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, data=out.tobytes()),
                timing=pb.Timing(batch_size=batch_size),
            )
            return Response(resp.SerializeToString(), media_type="application/octet-stream")

    return RayAttention.bind(model)


class HttpTarget:
    """POSTs request bytes to a URL over a keep-alive connection pool (aiohttp)."""

    def __init__(self, url: str, *, connections: int = 64) -> None:
        self.url = url
        self.connections = connections
        self._session: Any = None

    async def send(self, payload: bytes, timeout: float | None) -> bytes:
        import aiohttp

        if self._session is None:  # made inside the running event loop
            connector = aiohttp.TCPConnector(limit=self.connections)
            self._session = aiohttp.ClientSession(connector=connector)
        headers = {"content-type": "application/octet-stream"}
        t = aiohttp.ClientTimeout(total=timeout)
        async with self._session.post(self.url, data=payload, headers=headers, timeout=t) as r:
            body = await r.read()
            if r.status != 200:
                raise TargetError(f"HTTP_{r.status}", body[:200].decode(errors="replace"))
            return body

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port; 0 picks a free one")
    p.add_argument("--model", default="mha")
    args = p.parse_args(argv)
    port = args.port or free_port()

    import ray
    from ray import serve

    # Ray's workers run this interpreter, so they import mha_serve as installed (pip -e).
    # A Ray of its own (never a cluster a dead `ray start` left in ray_current_cluster).
    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False)
    try:
        serve.start(http_options={"host": args.host, "port": port}, logging_config=LOGGING)
        serve.run(build_app(args.model), name="mha", route_prefix="/")
        print(f"listening on http://{args.host}:{port}/", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

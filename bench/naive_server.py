"""BASELINE, not mha-serve: the mha.v1 Attend server one writes in an afternoon.

grpc's tutorial server (a thread pool of 10 workers), one forward per request, no batching,
no queue bounds, no health service. Same module and seeded weights as mha-serve's built-in
models, so its answers equal mha-serve's. bench/run_all.py measures mha-serve against it.

    python bench/naive_server.py --port 0    # prints "listening on 127.0.0.1:PORT"

--echo answers every Attend with its own input and computes nothing: the ceiling of a
Python gRPC server on this machine, what the wire alone costs (bench/run_all.py measures it).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from concurrent import futures

import grpc
import numpy as np
import torch

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve.config import default_models
from mha_serve.model import MultiHeadAttention, init_weights

MAX_WORKERS = 10  # grpc's examples/python default
MAX_MESSAGE_BYTES = 64 * 2**20


class Echo(pb_grpc.AttentionServiceServicer):
    def Attend(self, request: pb.AttendRequest, context: grpc.ServicerContext) -> pb.AttendResponse:
        return pb.AttendResponse(model=request.model, output=request.input)


class NaiveAttention(pb_grpc.AttentionServiceServicer):
    def __init__(self) -> None:
        self.models: dict[str, MultiHeadAttention] = {}
        for spec in default_models():
            module = MultiHeadAttention(spec.attention)
            init_weights(module, spec.seed)
            self.models[spec.name] = module.eval()

    def Attend(self, request: pb.AttendRequest, context: grpc.ServicerContext) -> pb.AttendResponse:
        module = self.models.get(request.model)
        if module is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no model {request.model!r}")
        if request.input.dtype != pb.DTYPE_FLOAT32 or request.weights.enabled:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "the baseline serves float32, no weights")
        shape = tuple(request.input.shape)
        x = torch.from_numpy(np.frombuffer(request.input.data, np.float32).reshape(shape).copy())
        if x.dim() == 2:
            x = x[None]  # (L, E) -> (1, L, E)
        lengths = torch.tensor(list(request.lengths)) if request.lengths else None
        causal = request.causal if request.HasField("causal") else None
        with torch.inference_mode():
            out = module(x, lengths=lengths, causal=causal).output  # (B, L, E)
        out = out.reshape(shape).numpy()
        return pb.AttendResponse(
            model=request.model,
            output=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=out.shape, data=out.tobytes()),
            timing=pb.Timing(batch_size=x.shape[0]),
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--workers", type=int, default=MAX_WORKERS, help="gRPC thread pool size")
    p.add_argument("--echo", action="store_true", help="return the input; no compute")
    args = p.parse_args(argv)
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.workers), options=options)
    pb_grpc.add_AttentionServiceServicer_to_server(
        Echo() if args.echo else NaiveAttention(), server
    )
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    print(f"listening on {args.host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

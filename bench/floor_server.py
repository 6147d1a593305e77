"""The floor server: the least a one-process Python grpc.aio server does for the work that
bench/overhead.py serves through mha-serve (issue 25's targets), measured beside it.

    python bench/floor_server.py --port PORT [--attend inline|batched]   # prints "floor ready"

Nothing of mha-serve is in its path but the generated messages (mha_client.api) and the
models' weights (bench/inprocess.load); with --busy-poll-us, its event loop's selector
(mha_serve.transport.busy_poll), which only decides how the loop waits:

- StreamSession (bidi, bytes): each message is parsed with AttendRequest.FromString, its
  input's bytes taken as a numpy view into torch, overhead.BareStep run on it (fused qkv, the
  stream's K/V of the context's length, scaled_dot_product_attention, wo; one torch thread,
  inline on the event loop) and answered with an AttendResponse (output in the server's
  tensor layout, model, session, timing) serialized with SerializeToString. A step request
  names no model or position, so the stream's metadata does: floor-model, floor-start (the
  first step's position; each message is one token, the next position) and floor-context
  (the K/V's length: the served session's context). Streams of one (model, context) share
  its K/V (positions before floor-start stay zero, as in overhead's in-process step), so they
  must not overlap: a second at once is refused (FAILED_PRECONDITION). With floor-spin-us
  in its metadata a stream instead waits that long per message (a busy wait holding the
  interpreter, as the step's Python does between its ops) and answers zeros: the same
  messages and the same time between them without the step's memory traffic.
- Attend (unary): the module's forward (inprocess.load(model)(x).output, what overhead's
  in-process ceiling times) on the request's input. --attend inline: on the event loop, one
  torch thread. --attend batched: requests go from the event loop to one worker thread that
  runs one forward for everything queued (stacked per model and shape; torch on all cores)
  and answers each through loop.call_soon_threadsafe: the minimal batching server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import BareStep, serve_methods  # noqa: E402

from mha_client.api import attention_pb2 as pb  # noqa: E402

# The input's bytes are a read-only view of the received message: torch warns, and nothing
# writes into them (the step copies its K/V in, a batch is stacked into a new tensor).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


class Refused(Exception):
    """A request the floor cannot answer: its status code and a message saying why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def input_tensor(request: pb.AttendRequest, embed_dim: int) -> Any:
    """The request's input as a (B, L, E) float32 torch view of its bytes (no copy)."""
    import torch

    t = request.input
    shape = tuple(t.shape)
    if t.dtype != pb.DTYPE_FLOAT32 or len(shape) not in (2, 3) or shape[-1] != embed_dim:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input is {pb.DType.Name(t.dtype)} {list(shape)}; the floor takes DTYPE_FLOAT32 "
            f"(L, {embed_dim}) or (B, L, {embed_dim})",
        )
    if len(t.data) != 4 * int(np.prod(shape)):
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input.data has {len(t.data)} bytes; shape {list(shape)} needs "
            f"{4 * int(np.prod(shape))}",
        )
    x = np.frombuffer(t.data, np.float32).reshape(shape if len(shape) == 3 else (1, *shape))
    return torch.from_numpy(x)  # (B, L, E)


def one_token(x: Any, pos: int, capacity: int) -> Any:
    """x (B, T, E) if it is one step's token and the K/V has room for it at pos."""
    if x.shape[0] != 1 or x.shape[1] != 1:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a floor step is one token, (1, E) or (1, 1, E); got {list(x.shape)}",
        )
    if pos >= capacity:
        raise Refused(
            grpc.StatusCode.OUT_OF_RANGE,
            f"position {pos} is past the stream's floor-context {capacity}",
        )
    return x


def reply(
    request: pb.AttendRequest, model: str, y: Any, received: float, batch_size: int = 1
) -> pb.AttendResponse:
    """An AttendResponse as mha-serve's fills it: output in the input's rank, model, timing
    (batch_size: sequences in the forward that ran it)."""
    response = pb.AttendResponse(model=model)
    out = response.output
    out.dtype = pb.DTYPE_FLOAT32
    out.shape[:] = request.input.shape  # (B, L, E) or (L, E), as the input
    out.data = y.numpy().tobytes()
    response.timing.total_ms = (time.perf_counter() - received) * 1e3
    response.timing.batch_size = batch_size
    return response


def step_reply(
    request: pb.AttendRequest, key: tuple[str, int], y: Any, num_tokens: int, received: float
) -> bytes:
    """A stream step's reply, serialized: reply() and the session's (id, model of the
    stream's key, its tokens after the step, the key's context as max_len)."""
    response = reply(request, key[0], y, received)
    s = response.session
    s.session_id, s.model, s.num_tokens, s.max_len = request.session_id, key[0], num_tokens, key[1]
    return response.SerializeToString()


class Floor:
    """The floor's handlers. modules: Attend's forward per model; steps: one BareStep (weights
    and K/V) per (model, context), built on a stream's first use."""

    def __init__(self, batched: bool) -> None:
        self.batched = batched
        self.modules: dict[str, Any] = {}
        self.steps: dict[tuple[str, int], BareStep] = {}
        self.busy: set[tuple[str, int]] = set()
        self.worker: BatchWorker | None = None

    def module(self, model: str) -> Any:
        module = self.modules.get(model)
        if module is None:
            from inprocess import load

            try:
                module = self.modules[model] = load(model)
            except KeyError:
                raise Refused(
                    grpc.StatusCode.NOT_FOUND, f"model {model!r}: the floor has mha, gqa, mqa"
                ) from None
        return module

    async def stream(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            key, pos = self._stream_key(context)
            spin_s = self._spin_s(context)
        except Refused as err:
            await context.abort(err.code, str(err))
        if spin_s is not None:
            async for data in self._spin(requests, key, pos, spin_s):
                yield data
            return
        if key in self.busy:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"another stream is stepping {key[0]} at context {key[1]}: they share its K/V",
            )
        self.busy.add(key)
        try:
            step = self.steps.get(key)
            if step is None:
                self.module(key[0])  # NOT_FOUND for an unknown model
                step = self.steps[key] = BareStep(key[0], key[1])
            embed_dim = step.module.config.embed_dim
            async for data in requests:
                received = time.perf_counter()
                request = pb.AttendRequest.FromString(data)
                try:
                    x = one_token(input_tensor(request, embed_dim), pos, key[1])  # (1, 1, E)
                except Refused as err:
                    await context.abort(err.code, str(err))
                y = step(x, pos)  # (1, 1, E)
                pos += 1
                yield step_reply(request, key, y, pos, received)
        finally:
            self.busy.discard(key)

    async def _spin(self, requests: Any, key: tuple[str, int], pos: int, spin_s: float) -> Any:
        """The floor's stream with the step replaced by a busy wait of spin_s (the bare step's
        time in a tight loop) and a zero output: what waiting that long between the wire's
        messages costs a server, without the step's memory traffic."""
        import torch

        embed_dim = self.module(key[0]).config.embed_dim
        zeros = torch.zeros(1, 1, embed_dim)
        async for data in requests:
            received = time.perf_counter()
            request = pb.AttendRequest.FromString(data)
            input_tensor(request, embed_dim)  # the same parse and checks as a step's
            end = received + spin_s
            while time.perf_counter() < end:
                pass
            pos += 1
            yield step_reply(request, key, zeros, pos, received)

    @staticmethod
    def _spin_s(context: grpc.aio.ServicerContext) -> float | None:
        """floor-spin-us from the stream's metadata, in seconds (None: a real step)."""
        value = dict(context.invocation_metadata() or ()).get("floor-spin-us")
        if value is None:
            return None
        try:
            spin_us = float(value)
        except ValueError:
            spin_us = -1.0
        if not 0 <= spin_us <= 1e6:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"floor-spin-us {value!r} must be a number of microseconds in [0, 1e6]",
            )
        return spin_us * 1e-6

    @staticmethod
    def _stream_key(context: grpc.aio.ServicerContext) -> tuple[tuple[str, int], int]:
        meta = dict(context.invocation_metadata() or ())
        try:
            model = meta["floor-model"]
            start, capacity = int(meta["floor-start"]), int(meta["floor-context"])
        except (KeyError, ValueError):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a floor stream needs metadata floor-model (mha, gqa, mqa), floor-start (the "
                f"first step's position) and floor-context (the K/V's length); got {meta}",
            ) from None
        if not 0 <= start < capacity:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"floor-start {start} must be in [0, floor-context {capacity})",
            )
        return (model, capacity), start

    async def attend(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        import torch

        received = time.perf_counter()
        request = pb.AttendRequest.FromString(data)
        try:
            module = self.module(request.model)
            x = input_tensor(request, module.config.embed_dim)  # (B, L, E)
        except Refused as err:
            await context.abort(err.code, str(err))
        if self.worker is not None:
            return await self.worker.submit(request, module, x, received)
        with torch.inference_mode():
            y = module(x).output  # (B, L, E)
        return reply(request, request.model, y, received, y.shape[0]).SerializeToString()


class BatchWorker:
    """One thread running one forward for all Attends queued since its last (stacked per
    module and shape), answering each on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: list[tuple[pb.AttendRequest, Any, Any, float, asyncio.Future]] = []
        self.ready = threading.Condition()
        threading.Thread(target=self.run, name="floor-batch", daemon=True).start()

    def submit(
        self, request: pb.AttendRequest, module: Any, x: Any, received: float
    ) -> asyncio.Future:
        done = self.loop.create_future()
        with self.ready:
            self.queue.append((request, module, x, received, done))
            self.ready.notify()
        return done

    def run(self) -> None:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)  # this thread's forwards: every core
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                queued, self.queue = self.queue, []
            groups: dict[tuple[int, tuple[int, ...]], list] = {}
            for item in queued:
                groups.setdefault((id(item[1]), tuple(item[2].shape[1:])), []).append(item)
            for items in groups.values():
                try:
                    with torch.inference_mode():
                        y = items[0][1](torch.cat([x for _, _, x, _, _ in items])).output
                    ys = y.split([x.shape[0] for _, _, x, _, _ in items])  # (B_i, L, E) each
                    answers = [
                        reply(r, r.model, yi, t, y.shape[0]).SerializeToString()
                        for (r, _, _, t, _), yi in zip(items, ys, strict=True)
                    ]
                except Exception as err:  # every caller hears it; the worker goes on
                    for *_, done in items:
                        self.loop.call_soon_threadsafe(_settle, done, None, err)
                    continue
                for (*_, done), answer in zip(items, answers, strict=True):
                    self.loop.call_soon_threadsafe(_settle, done, answer, None)


def _settle(done: asyncio.Future, answer: bytes | None, error: BaseException | None) -> None:
    if done.done():  # the caller went away (cancelled)
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(answer)


async def serve_floor(port: int, batched: bool) -> None:
    import torch

    torch.set_num_threads(1)  # the stream's step and inline Attend, as mha-serve's lone step
    floor = Floor(batched)
    if batched:
        floor.worker = BatchWorker(asyncio.get_running_loop())
    for model in ("mha", "gqa", "mqa"):
        floor.module(model)
    await serve_methods(port, floor.attend, floor.stream, "floor")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument(
        "--attend",
        choices=("inline", "batched"),
        default="inline",
        help="inline: each Attend's forward on the event loop, one torch thread; batched: "
        "one worker thread runs one forward for all queued, on every core",
    )
    p.add_argument(
        "--busy-poll-us",
        type=int,
        default=0,
        metavar="US",
        help="its event loop polls this long for the next event before it blocks, as "
        "mha-serve's --busy-poll-us (the same selector: mha_serve.transport.busy_poll)",
    )
    args = p.parse_args(argv)
    serving = serve_floor(args.port, args.attend == "batched")
    if args.busy_poll_us:
        from mha_serve.transport import busy_poll

        busy_poll.run(serving, args.busy_poll_us)
    else:
        asyncio.run(serving)
    return 0


if __name__ == "__main__":
    sys.exit(main())

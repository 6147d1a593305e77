"""A batch of decode steps (one new token per session) with static shapes, so that a CUDA
graph can capture it: today's batched step (Sessions._forward with engine/attend.py) spends
4-7 ms of host time at 64 sessions on an H200, its graph replay 0.5 ms
(docs/benchmarks-gpu.md, "CUDA graphs for the decode step").

The batch is padded up to a batch bucket (padding rows copy row 0: the same token written to
the same slot with the same values, outputs dropped) and its key width up to a multiple of
key_bucket. Every per-step integer (write slot, position, key count, read offset, block
table) travels in one host-to-device copy into a static buffer; after it the step is tensor
ops of fixed shapes with no host sync: project, RoPE, write K/V, key slots from the block
tables, gather, mask, attention, wo, and the overflow check's maxima. Eager mode runs those
ops as they are (any device); graph mode (CUDA) captures them once per (batch bucket, key
width) and replays.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mha_serve.cache import KVCache, Reservation
from mha_serve.engine.types import HostedModel
from mha_serve.model import AttentionConfig, MultiHeadAttention
from mha_serve.model.overflow import row_absmax_tensor
from mha_serve.model.padded import attend_padded

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
KEY_BUCKET = 256  # key widths are multiples of this (memory-efficient SDPA wants 16)
# Graphs kept at most: least recently used ones beyond it are dropped (and captured again
# if their shapes come back). 7 batch buckets x 16 key widths (4096 keys) fit.
MAX_GRAPHS = 128
# Columns of a row of the integer buffer before its block table.
_SLOT, _POS, _LEN, _OFF, _TABLE = range(5)
# One capture at a time in the process: a capture empties the allocator's cache first, and two
# at once would contend for it (each StaticDecode captures on a stream of its own, in
# thread-local mode, so other threads' CUDA work goes on meanwhile).
_CAPTURE = threading.Lock()


@dataclass
class DecodeResult:
    """What Sessions._forward reads of a batch of decode steps, for the B real rows."""

    output: torch.Tensor  # (B, 1, E) in the model's dtype
    q: torch.Tensor  # (B, H, 1, D): the queries (the exact overflow check reads them)
    # (4, B) float32 on the device: max |q|, |k|, |v| (k, v in the cache's dtype) and
    # |output| of each row, as row_absmax_tensor(q, k_new, v_new) and of the output today.
    maxima: torch.Tensor


class StaticDecode:
    """Decode steps of one model over its KVCache in fixed shapes; graph=True captures them
    into CUDA graphs (CUDA only). Not thread-safe: one step at a time (the static buffers
    are shared by every bucket)."""

    def __init__(
        self,
        hosted_or_module: HostedModel | MultiHeadAttention,
        cache: KVCache,
        *,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        key_bucket: int = KEY_BUCKET,
        max_seq_len: int | None = None,
        graph: bool = False,
        max_graphs: int = MAX_GRAPHS,
    ) -> None:
        if isinstance(hosted_or_module, HostedModel):
            module = hosted_or_module.module
            max_seq_len = max_seq_len or hosted_or_module.spec.max_seq_len
        else:
            module = hosted_or_module
        config = module.config
        if not self.supports(config):
            raise ValueError(
                "StaticDecode does not run models with a q/k norm or multi-head latent "
                "attention; use the engine's step"
            )
        buckets = sorted(set(batch_buckets))
        if not buckets or buckets[0] < 1 or key_bucket < 1 or key_bucket % 16:
            raise ValueError(
                f"batch_buckets {tuple(batch_buckets)} must be ints >= 1 and key_bucket "
                f"{key_bucket} a positive multiple of 16"
            )
        weight = module.wqkv.weight
        if weight.device != cache.device:
            raise ValueError(f"the model is on {weight.device} but its cache on {cache.device}")
        if graph and cache.device.type != "cuda":
            raise ValueError(f"graph mode needs CUDA; the model is on {cache.device}")
        self.module, self.cache, self.config = module, cache, config
        self.device, self.dtype = cache.device, weight.dtype
        self.batch_buckets, self.key_bucket = tuple(buckets), key_bucket
        self.graph, self.max_graphs = graph, max_graphs
        # Widest key width a step may need: a session holds at most max_seq_len keys (and
        # never more than the cache's slots), rounded up to 16 for the kernel.
        longest = min(max_seq_len or cache.num_slots, cache.num_slots)
        self.max_width = -(-longest // 16) * 16
        # One row per step: slot, position, keys, offset, then the block table (padded).
        cols = _TABLE + self._table_width(self.max_width)
        pinned = self.device.type == "cuda"
        size = buckets[-1] * cols
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=pinned)
        self._host_np = self._host.numpy()
        self._copied = None  # CUDA: an event after the last copy out of _host
        self._capture_stream = None  # graph mode: the stream its captures run on
        if pinned:
            with torch.cuda.device(self.device):  # the model's device, not the current one
                self._copied = torch.cuda.Event()
                if graph:
                    self._capture_stream = torch.cuda.Stream(self.device)
        self._ints = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._x = torch.zeros(
            buckets[-1], 1, config.embed_dim, dtype=self.dtype, device=self.device
        )
        self._graphs: OrderedDict[tuple[int, int], tuple] = OrderedDict()
        self._pool = None
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None  # eager mode's
        self.captures = 0  # graphs captured so far (a replay of a known shape adds none)
        # Seconds the captures took in all, and the longest: a capture runs on the step's own
        # thread (the event loop's, for a lone step run inline) and holds it that long.
        self.capture_s = 0.0
        self.longest_capture_s = 0.0
        self.steps = 0  # batches of steps run

    @staticmethod
    def supports(config: AttentionConfig) -> bool:
        """MHA, GQA and MQA, with or without RoPE (any scaling), a sliding window (a decode
        step's window is its reservation's read_start: it sees every key it reads),
        soft-capping, attention sinks and ALiBi (the explicit kernel has static shapes too,
        ALiBi's positions come from the step's buffer). Not
        yet a q/k norm (the module's project would run it, but no test here covers it in
        fixed shapes), nor MLA (its merge is not wo alone) nor an output gate (its merge
        takes the gate's own projection of the input), nor queries scaled by position
        (project would scale them, from the step's positions, but no GPU test covers it
        yet): those models keep the engine's step."""
        return (
            config.qk_norm is None
            and config.mla is None
            and not config.output_gate
            and config.query_scale is None
        )

    def width(self, num_keys: int) -> int:
        """The key width a step reading num_keys keys runs at."""
        if not 1 <= num_keys <= self.max_width:
            raise ValueError(f"a step reads {num_keys} keys; this model holds 1..{self.max_width}")
        return min(-(-num_keys // self.key_bucket) * self.key_bucket, self.max_width)

    def bucket(self, batch: int) -> int:
        """The batch bucket `batch` steps run in."""
        for b in self.batch_buckets:
            if b >= batch:
                return b
        raise ValueError(
            f"{batch} steps exceed the largest batch bucket {self.batch_buckets[-1]}; split them"
        )

    def step(self, x: torch.Tensor, reservations: Sequence[Reservation]) -> DecodeResult:
        """B decode steps: x (B, 1, E) on the device, reservations[b] its step's (one new
        token). Writes their K/V into the cache and attends, as the engine's batched step.
        Under inference_mode."""
        B = len(reservations)
        E = self.config.embed_dim
        if x.shape != (B, 1, E) or x.dtype != self.dtype or x.device != self.device:
            raise ValueError(
                f"x must be ({B}, 1, {E}) {self.dtype} on {self.device}, got "
                f"{tuple(x.shape)} {x.dtype} on {x.device}"
            )
        if any(r.num_tokens != 1 for r in reservations):
            raise ValueError("StaticDecode runs decode steps: one new token per reservation")
        Bb = self.bucket(B)
        W = self.width(max(r.start + 1 - r.read_start for r in reservations))
        self.steps += 1
        cols = _TABLE + self._table_width(W)
        n = Bb * cols
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left _host
        rows = self._host_np[:n].reshape(Bb, cols)
        bs = self.cache.block_size
        for b, r in enumerate(reservations):
            lo = r.read_start // bs - r.first_block
            hi = -(-(r.start + 1) // bs) - r.first_block
            if lo < 0 or len(r.block_table) < hi:
                raise ValueError(
                    f"step {b}: positions {r.read_start}..{r.start} are not in its "
                    f"{len(r.block_table)} block(s) from block {r.first_block}"
                )
            row = rows[b]
            row[:_TABLE] = (r.slots[0], r.start, r.start + 1 - r.read_start, r.read_start % bs)
            row[_TABLE : _TABLE + hi - lo] = r.block_table[lo:hi]  # later entries: never read
        rows[B:] = rows[0]  # padding rows: row 0 again (same slot, same values)
        with torch.inference_mode(), self._on_device():
            self._ints[:n].copy_(self._host[:n], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
            self._x[:B].copy_(x)
            if Bb > B:
                self._x[B:Bb].copy_(x[:1].expand(Bb - B, 1, E))
            if not self.graph:
                out, q, maxima = self._compute(Bb, W)
                return DecodeResult(out[:B], q[:B], maxima[:, :B])
            graph, (out, q, maxima) = self._replayable(Bb, W)
            graph.replay()
            # Copies: the static outputs are overwritten by the next replay, and the pool's
            # memory is shared between graphs.
            return DecodeResult(out[:B].clone(), q[:B].clone(), maxima[:, :B].clone())

    def _on_device(self) -> contextlib.AbstractContextManager:
        """CUDA: the model's device made current for the step (events, streams and a
        capture otherwise land on the thread's current device, cuda:0, and a capture there
        would record none of the model's kernels on cuda:1)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def _table_width(self, width: int) -> int:
        """Block table entries a row of `width` keys may need: its first key may sit
        anywhere in its first block."""
        return -(-width // self.cache.block_size) + 1

    def _compute(self, Bb: int, W: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step on the static buffers, fixed shapes, no host sync: output (Bb, 1, E),
        q (Bb, H, 1, D), maxima (4, Bb)."""
        c, cache = self.config, self.cache
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        bs, num_slots = cache.block_size, cache.num_slots
        ints = self._ints[: Bb * (_TABLE + self._table_width(W))].view(Bb, -1)
        slot, pos, length, offset = (ints[:, i] for i in (_SLOT, _POS, _LEN, _OFF))  # (Bb,)
        table = ints[:, _TABLE:]  # (Bb, NB)
        x = self._x[:Bb]  # (Bb, 1, E)
        # (the module's rope_freq lives on its device: nothing copied inside a capture)
        q, k, v = self.module.project(x, pos[:, None])  # (Bb, H|KVH, 1, D)
        if k.dtype != cache.dtype:
            k, v = k.to(cache.dtype), v.to(cache.dtype)
        # Write: padding rows write row 0's slot with row 0's values (no other slot).
        for store, new in ((cache.k, k), (cache.v, v)):
            store.view(KVH, num_slots, D).index_copy_(1, slot, new[:, :, 0].transpose(0, 1))
        # Key slots, as KVCache.gather: column j is position read_start + j, past the row's
        # last key its last key again (finite, masked).
        j = torch.arange(W, device=self.device)[None]  # (1, W)
        p = offset[:, None] + torch.minimum(j, length[:, None] - 1)  # (Bb, W) from its table
        slots = table.gather(1, p // bs) * bs + p % bs  # (Bb, W)
        heads = torch.arange(KVH, device=self.device) * num_slots  # (KVH,)
        index = (heads[None, :, None] + slots[:, None, :]).view(-1)  # (Bb * KVH * W,)
        keys, values = (
            torch.index_select(store.view(KVH * num_slots, D), 0, index, out=buf).view(
                Bb, KVH, W, D
            )
            for store, buf in zip(
                (cache.k, cache.v), self._gather_buffers(index.numel()), strict=True
            )
        )
        allowed = (j < length[:, None])[:, None, None, :]  # (Bb, 1, 1, W)
        alibi = None
        if self.module.alibi is not None:
            # Column j is position read_start + j = pos - length + 1 + j, the token's pos:
            # absolute, as Falcon-RW's bfloat16 form needs (no host value).
            first = (pos - length + 1)[:, None]  # (Bb, 1)
            alibi = (self.module.alibi, pos[:, None], first + j)  # (Bb, 1), (Bb, W)
        y = attend_padded(
            q,
            keys,
            values,
            allowed,
            self.module.scale,
            softcap=c.softcap,
            sinks=self.module.sinks,
            alibi=alibi,
        )
        y = y.transpose(1, 2).reshape(Bb, 1, H * D)  # (Bb, 1, H*D)
        out = F.linear(y, self.module.wo.weight, self.module.wo.bias)  # (Bb, 1, E)
        return out, q, row_absmax_tensor(q, k, v, out)

    def _gather_buffers(self, rows: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Eager mode: kept (rows, D) buffers for the gathered K and V, grown when too small
        (on the CPU a fresh buffer per step costs more in page faults than the copy, as
        KVCache.gather's). Graph mode: None, the graph's pool holds them (a buffer that grew
        would leave earlier graphs reading freed memory)."""
        if self.graph:
            return None, None
        if self._gathered is None or self._gathered[0].shape[0] < rows:
            D, dtype = self.cache.head_dim, self.cache.dtype
            self._gathered = tuple(
                torch.empty(rows, D, dtype=dtype, device=self.device) for _ in "kv"
            )
        return self._gathered[0][:rows], self._gathered[1][:rows]

    def _replayable(self, Bb: int, W: int) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """The graph of (Bb, W) and its static outputs, captured on first use: warmed up on
        a side stream first (which runs this step: writing the same K/V again is harmless),
        all graphs in one memory pool; beyond max_graphs the least recently used goes."""
        key = (Bb, W)
        held = self._graphs.get(key)
        if held is not None:
            self._graphs.move_to_end(key)
            return held
        with _CAPTURE, _capturable_attention():
            started = time.perf_counter()  # (not the wait for another model's capture)
            graph, outputs = self._capture(Bb, W)
            took = time.perf_counter() - started
        self._pool = graph.pool()
        self.captures += 1
        self.capture_s += took
        self.longest_capture_s = max(self.longest_capture_s, took)
        log.info(
            "captured the decode step's CUDA graph for %d step(s) over %d keys in %.1f ms "
            "(%d captured, %.0f ms in all)",
            Bb,
            W,
            took * 1e3,
            self.captures,
            self.capture_s * 1e3,
        )
        self._graphs[key] = (graph, outputs)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return graph, outputs

    def _capture(self, Bb: int, W: int) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """Warm-up on the capture stream (cuBLAS handles, workspaces: off the capture), then
        the capture there, thread-local (other threads' CUDA work is not the capture's);
        the caller's stream is current again afterwards, also when the capture fails (torch
        restores it only after a capture that ends well)."""
        caller = torch.cuda.current_stream(self.device)
        stream = self._capture_stream
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                self._compute(Bb, W)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"
            ):
                outputs = self._compute(Bb, W)
        finally:
            torch.cuda.set_stream(caller)
        caller.wait_stream(stream)
        return graph, outputs

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


@contextlib.contextmanager
def _capturable_attention() -> Iterator[None]:
    """SDPA's memory-efficient kernel (math as the last resort) while capturing: cuDNN's
    (when --cudnn-attention lets it run) has had illegal memory accesses inside CUDA graphs
    with a boolean mask over more than 1024 keys (cuDNN 9.13-9.14), an error no fallback
    survives; a replay runs what was captured."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield

"""The model-level pieces of bench/gpu.py: timers, the HBM roofline, and a decode step of B
sessions over the paged KV cache, eager or replayed from a CUDA graph.

Device-agnostic, so the tests run every piece on the CPU with tiny shapes (graphs aside);
bench/gpu.py runs them on CUDA. Timings on CUDA come from device events around a loop of
calls (what a back-to-back decode loop sustains, launch gaps included); on the CPU from the
wall clock.
"""

from __future__ import annotations

import inspect
import math
import re
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from mha_serve.cache import KVCache, Reservation
from mha_serve.config import default_models
from mha_serve.engine.attend import BATCHED_MIN_FILL, FlashKernel, attend_steps, flash_varlen
from mha_serve.model import MultiHeadAttention, init_weights

# Datasheet HBM bandwidth in GB/s (1e9 bytes/s), by device name as torch reports it; the first
# match wins. A lead, printed beside the run's own measured copy bandwidth, which is the
# roofline every ratio uses.
DATASHEET_GBS = (
    (r"H200", 4800),
    (r"H100.*NVL", 3900),
    (r"H100.*PCIe", 2000),
    (r"H100", 3350),  # SXM5, 80 GB HBM3 ("NVIDIA H100 80GB HBM3")
    (r"A100-SXM4-80GB", 2039),
    (r"A100 80GB PCIe", 1935),
    (r"A100", 1555),
    (r"L40S", 864),
    (r"L4\b", 300),
    (r"A10G?\b", 600),
    (r"V100", 900),
    (r"T4\b", 320),
)


def datasheet_gbs(name: str) -> int | None:
    """The datasheet HBM bandwidth (GB/s) of a device name, None when the table lacks it."""
    for pattern, gbs in DATASHEET_GBS:
        if re.search(pattern, name):
            return gbs
    return None


def load_module(name: str, device: torch.device, dtype: torch.dtype) -> MultiHeadAttention:
    """A built-in model (mha, gqa, mqa) with the weights every server computes with."""
    spec = {s.name: s for s in default_models()}[name]
    module = MultiHeadAttention(spec.attention, device=device, dtype=dtype)
    init_weights(module, spec.seed)
    return module.eval().requires_grad_(False)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_s(
    run: Callable[[int], object],
    device: torch.device,
    *,
    groups: int = 1,
    calls: int = 20,
    reps: int = 5,
    warmup: int = 3,
) -> float:
    """Median over `reps` of the mean time of `calls` back-to-back run(i % groups) calls."""
    for i in range(warmup * groups):
        run(i % groups)
    samples = []
    for _ in range(reps):
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(calls):
                run(i % groups)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t = time.perf_counter()
            for i in range(calls):
                run(i % groups)
            samples.append((time.perf_counter() - t) / calls)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Bytes/s of a device-to-device copy of nbytes, counting bytes read plus bytes written:
    the roofline a K/V read is held against (METHOD: measure the ceiling on the machine)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / per_call_s(lambda _: dst.copy_(src), device, calls=5, reps=reps)


def kv_read_bytes(module: MultiHeadAttention, batch: int, context: int, itemsize: int) -> int:
    """Bytes of K and V one decode step of `batch` sessions at `context` must read."""
    c = module.config
    return batch * 2 * c.num_kv_heads * context * c.head_dim * itemsize


# torch's paged flash kernel (varlen_attn's block_table, torch >= 2.13) takes pages of a
# multiple of 256 tokens ("Paged KV cache block size must be divisible by 256"): paged()
# reads the cache's 16-token blocks as 256-token pages, so each bench session's blocks start
# on a page.
PAGE_TOKENS = 256


class DecodeBench:
    """One model's decode step for `batch` sessions at `context` (context - 1 tokens cached,
    one new; or session b at contexts[b], ragged) with the engine's ops: project, write the
    new K/V into the paged cache, `attend_cached` over each session's keys (in-place views:
    consecutive blocks, as the block pool lays out a session it can), wo. Inputs live in
    static buffers, so a step can be captured into a CUDA graph and replayed. `engine`: the
    same attention as the engine runs a batch now (engine/attend.py, batched).

    `groups` sets of `batch` sessions (enough that one pass over them is at least
    min_pool_bytes of K/V): each call steps the next set, so repeated calls read HBM rather
    than the L2 cache. K/V are random, never zeros (they hide unwritten memory).
    """

    def __init__(
        self,
        module: MultiHeadAttention,
        batch: int,
        context: int,
        *,
        min_pool_bytes: int = 0,
        block_size: int = 16,
        seed: int = 0,
        contexts: list[int] | None = None,
    ) -> None:
        c = module.config
        weight = module.wqkv.weight
        contexts = [context] * batch if contexts is None else list(contexts)
        assert len(contexts) == batch and max(contexts) == context, "contexts: batch, max context"
        self.module, self.batch, self.context, self.contexts = module, batch, context, contexts
        self.device, self.dtype = weight.device, weight.dtype
        KVH, D, E = c.num_kv_heads, c.head_dim, c.embed_dim
        self.step_bytes = sum(kv_read_bytes(module, 1, n, weight.element_size()) for n in contexts)
        self.groups = max(1, math.ceil(min_pool_bytes / self.step_bytes))
        blocks = -(-context // block_size)  # per session, the longest's
        per_page = PAGE_TOKENS // block_size  # blocks per paged() page
        stride = -(-blocks // per_page) * per_page  # session s's blocks start at s * stride
        sessions = self.groups * batch
        per_block = block_size * 2 * KVH * D * weight.element_size()
        self.cache = KVCache(
            num_kv_heads=KVH,
            head_dim=D,
            budget_bytes=sessions * stride * per_block,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
        )
        g = torch.Generator(device=self.device).manual_seed(seed)
        self.cache.k.normal_(generator=g)
        self.cache.v.normal_(generator=g)
        n_of = [contexts[s % batch] for s in range(sessions)]  # session s's context
        ids = [
            list(range(s * stride, s * stride + -(-n_of[s] // block_size))) for s in range(sessions)
        ]
        self.kv = [  # per group: batch (keys, values) views, (1, KVH, contexts[b], D) each
            [self.cache.read(ids[gi * batch + b], contexts[b]) for b in range(batch)]
            for gi in range(self.groups)
        ]
        new_slot = [table[0] * block_size + n - 1 for table, n in zip(ids, n_of, strict=True)]
        self.slots = torch.tensor(new_slot, device=self.device).view(self.groups, batch)
        self.reservations = [  # per group: what the engine's attention reads of each session
            [
                Reservation(f"s{s}", "bench", n_of[s] - 1, 1, tuple(ids[s]), (new_slot[s],), 0)
                for s in range(gi * batch, (gi + 1) * batch)
            ]
            for gi in range(self.groups)
        ]
        self.x = torch.randn(self.groups, batch, 1, E, generator=g, device=self.device)
        self.x = self.x.to(self.dtype)  # (G, B, 1, E): the new tokens
        self.q = [module.project(self.x[gi])[0] for gi in range(self.groups)]  # (B, H, 1, D)
        self.past, self.new = [n - 1 for n in contexts], [1] * batch
        self._contiguous: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # paged(): per group, each session's page table (its 256-token pages, padded with
        # its last) and its length, int32 as the kernel takes them; the queries' offsets
        pages = stride // per_page
        self._tables = [
            (
                torch.tensor(
                    [
                        list(range(s * pages, s * pages + -(-n_of[s] // PAGE_TOKENS)))
                        + [s * pages + (n_of[s] - 1) // PAGE_TOKENS]
                        * (pages - -(-n_of[s] // PAGE_TOKENS))
                        for s in range(g0, g0 + batch)
                    ],
                    dtype=torch.int32,
                    device=self.device,
                ),
                torch.tensor(n_of[g0 : g0 + batch], dtype=torch.int32, device=self.device),
            )
            for g0 in range(0, sessions, batch)
        ]
        self._cu_q = torch.arange(batch + 1, dtype=torch.int32, device=self.device)
        self._pool: tuple[torch.Tensor, torch.Tensor] | None = None

    def timed(self, fn: Callable[[int], object]) -> float:
        """per_call_s of fn over this bench's groups (each call the next group)."""
        calls = max(20, 2 * self.groups)
        return per_call_s(fn, self.device, groups=self.groups, calls=calls)

    def attend(self, group: int) -> torch.Tensor:
        """The K/V-reading part alone: group's static queries over its cached keys, and wo."""
        out = self.module.attend_cached(
            self.q[group], self.kv[group], past_lengths=self.past, new_lengths=self.new
        )
        return out.output  # (B, 1, E)

    def engine(
        self, group: int, min_fill: float = BATCHED_MIN_FILL, flash: FlashKernel | None = None
    ) -> torch.Tensor:
        """The K/V-reading part as the engine runs a batch now: padded groups of sessions'
        K/V gathered from the cache, one kernel each (engine/attend.py), and wo. min_fill 0:
        every session in one group, however unequal. flash: read in place by it instead."""
        out = attend_steps(
            self.module,
            self.cache,
            self.q[group],
            self.reservations[group],
            self.new,
            batched=True,
            min_fill=min_fill,
            flash=flash,
        )
        return out.output  # (B, 1, E)

    def in_place(self, group: int) -> torch.Tensor:
        """The K/V-reading part as the engine runs a batch with --flash-decode: each session's
        K/V read where they lie by one flash kernel (engine/attend.py's flash_varlen over the
        cache viewed token-major, each session's first slot and length), no gather, and
        wo."""
        if self.device.type != "cuda":
            raise RuntimeError("flash decode needs CUDA (flash attention)")
        return self.engine(group, flash=flash_varlen)

    def paged(self, group: int, pool: bool = False) -> torch.Tensor:
        """The K/V-reading part through torch's paged attention kernel
        (torch.nn.attention.varlen.varlen_attn with each session's page table and length:
        flash attention's decode, CUDA only, torch >= 2.13), each session's pages read where
        they are, no gather: over the cache's K/V as a (pages, 256, KVH, D) view of its (KVH,
        blocks, block_size, D) storage (16 blocks a page), or (pool) over a copy laid out so,
        made once outside the timing (what a cache laid out for the kernel would hold). Then
        wo."""
        if self.device.type != "cuda":
            raise RuntimeError("torch's paged varlen_attn needs CUDA (flash attention)")
        from torch.nn.attention.varlen import varlen_attn

        if "block_table" not in inspect.signature(varlen_attn).parameters:
            raise RuntimeError(
                f"torch {torch.__version__}'s varlen_attn takes no block_table (torch 2.13's does)"
            )
        KVH, D = self.cache.num_kv_heads, self.cache.head_dim
        k, v = (
            t.view(KVH, -1, PAGE_TOKENS, D).permute(1, 2, 0, 3)
            for t in (self.cache.k, self.cache.v)
        )
        if pool:
            if self._pool is None:
                self._pool = (k.contiguous(), v.contiguous())
            k, v = self._pool
        table, lengths = self._tables[group]
        c = self.module.config
        y = varlen_attn(
            self.q[group][:, :, 0],  # (B, H, D): one query per session
            k,
            v,
            self._cu_q,
            None,
            1,
            self.context,
            scale=self.module.scale,
            enable_gqa=c.num_kv_heads != c.num_heads,
            seqused_k=lengths,
            block_table=table,
        )  # (B, H, D)
        y = y.reshape(self.batch, 1, c.num_heads * c.head_dim)
        return F.linear(y, self.module.wo.weight, self.module.wo.bias)  # (B, 1, E)

    def step(self, group: int) -> torch.Tensor:
        """The whole decode step of group's sessions; their new K/V land at position
        context - 1, inside the views attend_cached reads."""
        m, KVH = self.module, self.module.config.num_kv_heads
        q, k, v = m.project(self.x[group])  # (B, H, 1, D), (B, KVH, 1, D) x 2
        slots = self.slots[group]  # (B,)
        for cache, new in ((self.cache.k, k), (self.cache.v, v)):
            flat = cache.view(KVH, self.cache.num_slots, -1)  # (KVH, slots, D)
            flat.index_copy_(1, slots, new[:, :, 0].transpose(0, 1))  # (KVH, B, D)
        out = m.attend_cached(q, self.kv[group], past_lengths=self.past, new_lengths=self.new)
        return out.output  # (B, 1, E)

    def batched(self, group: int) -> torch.Tensor:
        """What one launch over the batch can do: the same queries and K/V copied once (as the
        cache holds them at the group's first call) into contiguous (B, KVH, context, D)
        tensors, one scaled_dot_product_attention, wo. Equal contexts only."""
        if group not in self._contiguous:
            k = torch.cat([k for k, _ in self.kv[group]])  # (B, KVH, context, D)
            v = torch.cat([v for _, v in self.kv[group]])
            self._contiguous[group] = (k, v)
        m, c = self.module, self.module.config
        k, v = self._contiguous[group]
        y = F.scaled_dot_product_attention(
            self.q[group], k, v, scale=m.scale, enable_gqa=c.num_kv_heads != c.num_heads
        )  # (B, H, 1, D)
        y = y.transpose(1, 2).reshape(self.batch, 1, c.num_heads * c.head_dim)
        return F.linear(y, m.wo.weight, m.wo.bias)  # (B, 1, E)

    def reference(self, group: int) -> torch.Tensor:
        """The step's output recomputed plainly in float64 from the cache as it is now (after
        a step wrote the new K/V): per session softmax(q k^T * scale) v, heads merged, wo."""
        m, c = self.module, self.module.config
        G = c.num_heads // c.num_kv_heads
        q = m.project(self.x[group])[0].double()  # (B, H, 1, D)
        outs = []
        for b, (k, v) in enumerate(self.kv[group]):
            k = k[0].double().repeat_interleave(G, dim=0)  # (H, S, D): head h reads kv h // G
            v = v[0].double().repeat_interleave(G, dim=0)
            p = torch.softmax(q[b] @ k.transpose(-1, -2) * m.scale, dim=-1)  # (H, 1, S)
            outs.append((p @ v).transpose(0, 1).reshape(1, c.num_heads * c.head_dim))
        y = torch.stack(outs)  # (B, 1, H*D)
        bias = None if m.wo.bias is None else m.wo.bias.double()
        return F.linear(y, m.wo.weight.double(), bias)  # (B, 1, E)


class Graphs:
    """One CUDA graph of fn(group) per group, sharing one memory pool; replay(group) runs it
    and returns its static output (overwritten by the next replay of that group)."""

    def __init__(self, fn: Callable[[int], torch.Tensor], groups: int) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: cuBLAS handles, workspaces
            for gi in range(groups):
                fn(gi)
        torch.cuda.current_stream().wait_stream(stream)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list[torch.Tensor] = []
        pool = None
        for gi in range(groups):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs.append(fn(gi))
            pool = graph.pool()
            self.graphs.append(graph)

    def replay(self, group: int) -> torch.Tensor:
        self.graphs[group].replay()
        return self.outputs[group]


def lone_step_s(
    bench: DecodeBench, run: Callable[[int], torch.Tensor], steps: int, reps: int = 3
) -> float:
    """Median wall time of one session's step as a server takes it, one at a time: the token
    copied from host memory into the static input, the step, the output copied back."""
    host = torch.randn(steps, 1, 1, bench.module.config.embed_dim).to(bench.dtype)
    times = []
    for rep in range(reps + 1):  # rep 0 warms up
        for t in range(steps):
            start = time.perf_counter()
            bench.x[0].copy_(host[t])
            run(0).cpu()
            if rep:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----- one row of each table: bench/gpu.py's sections 2 and 3 ------------------------------


def attempt(row: dict, key: str, fn: Callable[[], object]) -> object:
    """row[key] = fn(), or None with the error under row["errors"][key]: one measurement that
    fails (a graph that cannot be captured, say) leaves the rest of the run standing."""
    try:
        row[key] = fn()
    except Exception as e:  # noqa: BLE001 - recorded and printed on the page
        row[key] = None
        row.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
    return row[key]


def eager_and_graph(b: DecodeBench, fn: Callable[[int], torch.Tensor], row: dict) -> Graphs | None:
    """row's eager_s, and graph_s and graph_max_diff (graph against eager output) of fn's
    CUDA graphs (None where they cannot be captured); returns the graphs."""
    row["graph_s"] = row["graph_max_diff"] = None
    attempt(row, "eager_s", lambda: b.timed(fn))
    graphs = attempt(row, "graph", lambda: Graphs(fn, b.groups))
    del row["graph"]
    if graphs is not None:
        attempt(row, "graph_s", lambda: b.timed(graphs.replay))
        attempt(row, "graph_max_diff", lambda: float((graphs.replay(0) - fn(0)).abs().max()))
    return graphs


def kv_row(module: MultiHeadAttention, batch: int, context: int, *, pool: int, roofline: float):
    """Section 2: the K/V-reading part of a decode step per session (eager, and from a
    graph), as the engine runs it batched, as one kernel over contiguous K/V, and through
    torch's paged kernel over the block tables (over the cache's layout, and over a pool
    laid out for it), each as a share of the roofline (bytes/s), and the errors of the
    step, the engine's attention and the paged kernel's."""
    b = DecodeBench(module, batch, context, min_pool_bytes=pool)
    row: dict = {"model": "", "batch": batch, "context": context, "kv_bytes": b.step_bytes}
    eager_and_graph(b, b.attend, row)
    attempt(row, "engine_s", lambda: b.timed(b.engine))
    attempt(row, "in_place_s", lambda: b.timed(b.in_place))
    attempt(row, "batched_s", lambda: b.timed(b.batched))
    attempt(row, "paged_s", lambda: b.timed(b.paged))
    attempt(row, "paged_pool_s", lambda: b.timed(partial(b.paged, pool=True)))
    got, ref = b.step(0).double(), b.reference(0)
    row["step_rel_error"] = float((got - ref).abs().max() / ref.abs().max())
    attempt(row, "engine_rel_error", lambda: rel_error(b.engine(0), ref))
    attempt(row, "in_place_rel_error", lambda: rel_error(b.in_place(0), ref))
    attempt(row, "paged_rel_error", lambda: rel_error(b.paged(0), ref))
    for k in ("eager", "graph", "engine", "in_place", "batched", "paged", "paged_pool"):
        t = row.get(f"{k}_s")
        row[f"{k}_share"] = None if t is None else b.step_bytes / t / roofline
    return row


def ragged_row(
    module: MultiHeadAttention, contexts: list[int], *, pool: int, roofline: float
) -> dict:
    """Section 2, ragged: sessions at unequal contexts (after the step wrote its token), per
    session, as the engine groups them (padding under half of a group), and all in one
    padded group; each as a share of the roofline counting only the real K/V bytes."""
    b = DecodeBench(module, len(contexts), max(contexts), min_pool_bytes=pool, contexts=contexts)
    b.step(0)  # every group's new K/V written: the reference reads the cache as it is
    row: dict = {"model": "", "batch": b.batch, "context": b.context, "kv_bytes": b.step_bytes}
    row["contexts"] = sorted(set(contexts))
    attempt(row, "eager_s", lambda: b.timed(b.attend))
    attempt(row, "engine_s", lambda: b.timed(b.engine))
    attempt(row, "one_group_s", lambda: b.timed(partial(b.engine, min_fill=0.0)))
    attempt(row, "in_place_s", lambda: b.timed(b.in_place))
    ref = b.reference(0)
    attempt(row, "engine_rel_error", lambda: rel_error(b.engine(0), ref))
    attempt(row, "one_group_rel_error", lambda: rel_error(b.engine(0, 0.0), ref))
    attempt(row, "in_place_rel_error", lambda: rel_error(b.in_place(0), ref))
    for k in ("eager", "engine", "one_group", "in_place"):
        t = row.get(f"{k}_s")
        row[f"{k}_share"] = None if t is None else b.step_bytes / t / roofline
    return row


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|."""
    return float((got.double() - ref).abs().max() / ref.abs().max())


def step_row(module: MultiHeadAttention, batch: int, context: int, *, pool: int, steps: int):
    """Section 3: the whole decode step eager and from a graph, back to back; for one
    session also taken alone, host to host."""
    b = DecodeBench(module, batch, context, min_pool_bytes=pool)
    row: dict = {"model": "", "batch": batch, "context": context}
    graphs = eager_and_graph(b, b.step, row)
    if batch == 1:
        attempt(row, "lone_eager_s", lambda: lone_step_s(b, b.step, steps))
        if graphs is not None:
            attempt(row, "lone_graph_s", lambda: lone_step_s(b, graphs.replay, steps))
    eager, graph = row.get("eager_s"), row.get("graph_s")
    row["speedup"] = eager / graph if eager and graph else None
    return row


# ----- section 7: attention at a new key length each call -------------------------------------

# The kernels a new-lengths row can ask for by name; "engine": none forced, whatever torch
# picks with the engine's switch (engine.choose_attention_kernels, cuDNN off by default).
SDPA_KERNELS = ("engine", "cudnn", "efficient", "flash", "math")


def new_length_row(
    device: torch.device,
    kernel: str,
    batch: int,
    *,
    mask: bool,
    bucket: int = 1,
    calls: int = 40,
    first_keys: int = 3000,
    heads: int = 8,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """One decode query per row over keys one longer each call (a growing session's step):
    the wall time of each call, synchronised (host work included: a kernel that plans per
    shape pays its plan here). bucket > 1 pads the keys up to a multiple of it and masks
    the padding, so calls share shapes. Median and worst of the calls after the first 5,
    and the first call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "math": SDPBackend.MATH,
    }
    if kernel not in SDPA_KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {', '.join(SDPA_KERNELS)}")
    row: dict = {"kernel": kernel, "batch": batch, "mask": mask, "bucket": bucket}
    g = torch.Generator(device=device).manual_seed(0)
    times = []
    for i in range(calls):
        keys = first_keys + i
        width = -(-keys // bucket) * bucket
        q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype, generator=g)
        k = torch.randn(batch, heads, width, head_dim, device=device, dtype=dtype, generator=g)
        v = torch.randn_like(k)
        allowed = None
        if mask:
            allowed = (torch.arange(width, device=device) < keys).expand(batch, 1, 1, width)
        synchronize(device)
        start = time.perf_counter()
        if kernel == "engine":
            F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        else:
            with sdpa_kernel([backends[kernel]]):
                F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        synchronize(device)
        times.append(time.perf_counter() - start)
    steady = sorted(times[5:]) if len(times) > 5 else sorted(times)
    row.update(
        first_s=times[0], median_s=statistics.median(steady), worst_s=steady[-1], calls=calls
    )
    return row

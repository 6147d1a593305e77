"""A sliding-window session over gRPC (Mistral, window 8, blocks of 16 tokens) at 12x its
window: every step equals transformers' attention, the session holds only the blocks its
next step can see (never more than 2), the model's cache and /metrics count the freed
ones; a fork and truncates back inside what is held stay exact; a truncate back past it is
refused with the lengths that work, and the session goes on unharmed."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from mha_client.errors import MhaServeError
from tests.models_hf.reference import WINDOW
from tests.models_hf.test_parity_grpc import assert_close, reference, reference_attention

BLOCK = 16  # the server's default kv_block_size
L = 12 * WINDOW


def held(num_tokens: int) -> int:
    """Blocks from the one holding the next step's first key (num_tokens + 1 - W) on."""
    return -(-num_tokens // BLOCK) - max(0, num_tokens + 1 - WINDOW) // BLOCK


def freed_blocks(proc) -> float:
    """mha_serve_kv_cache_window_freed_blocks_total{model="mistral"} from /metrics."""
    url = f"http://127.0.0.1:{proc.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith('mha_serve_kv_cache_window_freed_blocks_total{model="mistral"}'):
                return float(line.split()[-1])
    raise AssertionError("no mha_serve_kv_cache_window_freed_blocks_total for mistral")


def test_a_session_past_its_window_holds_only_what_the_window_needs(server):
    proc, client, models = server
    family, base, layer = reference(models, "mistral")
    x = torch.randn(L + 4, base.config.hidden_size, generator=torch.Generator().manual_seed(9))
    want, want_w = reference_attention(family, base, layer, x[None])  # all rows at once
    want, want_w = want[0], want_w[0]
    cache = {m.name: m.kv_cache for m in client.list_models()}["mistral"]
    assert cache.num_blocks_used == 0, "no other mistral session is open"
    freed_before = freed_blocks(proc)
    with client.create_session("mistral") as s:
        r = s.step(x[:20].numpy())
        assert_close(r.output, want[:20], what="prefill")
        for t in range(20, L):
            r = s.step(x[t : t + 1].numpy(), weights=t % 17 == 0)
            assert_close(r.output, want[t : t + 1], what=f"decode step {t}")
            if r.weights is not None:  # over absolute positions: zeros outside the window
                assert_close(r.weights, want_w[:, t : t + 1, : t + 1], what=f"weights {t}")
            assert r.session.num_blocks == held(t + 1) <= 2, f"blocks held at {t + 1}"
        assert r.session.bytes_held == held(L) * cache.bytes_per_token * BLOCK
        info = {m.name: m.kv_cache for m in client.list_models()}["mistral"]
        assert info.num_blocks_used == held(L)
        assert freed_blocks(proc) - freed_before == -(-L // BLOCK) - held(L)
        with s.fork() as child:  # shares the window's blocks
            r = child.step(x[L : L + 3].numpy())
            assert_close(r.output, want[L : L + 3], what="fork")
        # back inside what is held: positions >= 80 kept, the next token at 90 sees 83..
        first = (L + 1 - WINDOW) // BLOCK * BLOCK
        s.truncate(first + WINDOW - 1)
        r = s.step(x[first + WINDOW - 1 : L].numpy())
        assert_close(r.output, want[first + WINDOW - 1 : L], what="after truncate inside")
        with pytest.raises(MhaServeError, match=rf"to 0 or to {first + WINDOW - 1}\.\.{L}") as e:
            s.truncate(first + WINDOW - 2)  # its next token would see position first - 1
        assert e.value.code.name == "INVALID_ARGUMENT"
        r = s.step(x[L : L + 1].numpy())
        assert_close(r.output, want[L : L + 1], what="after a refused truncate")
        s.truncate(0)  # always possible
        r = s.step(x[:30].numpy())
        assert_close(r.output, want[:30], what="after truncate to 0")
        assert r.session.num_blocks == held(30)

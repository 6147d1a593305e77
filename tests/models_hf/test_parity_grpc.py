"""Attention layers of real Hugging Face checkpoints served over gRPC equal transformers'
own attention modules, fp32: all-MiniLM-L6-v2's six BERT layers on its real hidden states,
and checkpoints that transformers wrote: GPT-2, Llama (GQA, llama3 RoPE), Qwen2 (GQA, qkv
biases, yarn RoPE; and with use_sliding_window), Mistral (MQA, linear RoPE, a window of 8),
Qwen3 (q/k norm per head, head_dim != E/H, a window), OLMo-2 (q/k norm over the whole
projection), Gemma 2 (soft-capping, query_pre_attn_scalar; a local and a global layer),
Gemma 3 (q/k norm 1 + w, MQA, per-layer-type RoPE; local and global) and Phi-3 (fused qkv,
a window). Stateless (with padding, weights, query ranges) and sessions (prefill, decode
steps past the window, a fork, a truncate), outputs and per-head weights; the masks of
the windowed layers are transformers' own (masking_utils)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.models_hf.reference import (
    ABSOLUTE,
    SERVED,
    causal_mask,
    layer_window,
    load_reference,
    reference_attention,
)

ATOL = 1e-5  # fp32 against fp32: the same math summed in another order
RTOL = 1e-5
MINILM_NAMES = [f"minilm{i}" for i in range(6)]
HF_NAMES = list(SERVED)
SENTENCES = [
    "Attention heads specialise: some track syntax, others the previous token.",
    "Grouped-query attention shares each key and value head among several query heads.",
]


def assert_close(got, want, *, what, atol=ATOL, rtol=RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    diff = np.abs(got - want)
    ok = np.all(diff <= atol + rtol * np.abs(want))
    assert ok, f"{what}: max abs diff {diff.max():.3e}, mean {diff.mean():.3e} (atol {atol})"


_REFERENCES: dict = {}


def reference(models, name):
    family, directory, layer = models[name]
    key = (family, str(directory))
    if key not in _REFERENCES:
        _REFERENCES[key] = load_reference(family, directory)
    return ("bert" if family == "minilm" else family), _REFERENCES[key], layer


@pytest.fixture(scope="module")
def minilm_hidden(minilm_dir):
    """The real hidden states entering each MiniLM layer for two tokenised sentences, and
    the sentences' lengths: (layers + 1, 2, L, 384), padded at the end."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    model = load_reference("minilm", minilm_dir)
    with torch.no_grad():
        states = model(**batch, output_hidden_states=True).hidden_states
    return torch.stack(states), batch["attention_mask"].sum(1).tolist()


@pytest.mark.parametrize("name", MINILM_NAMES)
def test_minilm_layer_equals_transformers_bert_attention(served, minilm_hidden, name):
    client, models = served
    family, base, layer = reference(models, name)
    states, lengths = minilm_hidden
    x = states[layer]  # (2, L, 384): what layer `layer` of the real model receives
    got = client.attend(name, x.numpy(), lengths=lengths, weights=True)
    for b, n in enumerate(lengths):
        want, want_w = reference_attention(family, base, layer, x[b : b + 1, :n])
        assert_close(got.output[b, :n], want[0], what=f"{name} sentence {b} output")
        assert_close(got.weights[b, :, :n, :n], want_w[0], what=f"{name} sentence {b} weights")
        assert np.all(got.output[b, n:] == 0), "padded rows are 0"
    assert lengths[0] != lengths[1], "the batch must really be padded"


@pytest.mark.parametrize("name", HF_NAMES)
def test_transformers_written_layer_equals_its_attention_module(served, name):
    client, models = served
    family, base, layer = reference(models, name)
    E = base.config.hidden_size
    x = torch.randn(3, 24, E, generator=torch.Generator().manual_seed(1))
    lengths = [24, 17, 5]  # padded rows keep their real tokens' positions 0..n-1
    window = layer_window(base, layer) if family not in ABSOLUTE else None
    assert window is None or window < 17, "windowed layers: sequences longer than the window"
    got = client.attend(name, x.numpy(), lengths=lengths, weights=True)
    fast = client.attend(name, x.numpy(), lengths=lengths)  # the fused SDPA path
    rows = client.attend(  # narrowed weights: two heads, query rows 10..20
        name, x.numpy(), lengths=lengths, weights=True, heads=[3, 0], query_range=(10, 20)
    )
    for b, n in enumerate(lengths):
        want, want_w = reference_attention(family, base, layer, x[b : b + 1, :n])
        assert_close(got.output[b, :n], want[0], what=f"{name} row {b} output")
        assert_close(fast.output[b, :n], want[0], what=f"{name} row {b} output (no weights)")
        assert_close(got.weights[b, :, :n, :n], want_w[0], what=f"{name} row {b} weights")
        r = min(n, 20)
        if r > 10:
            part = rows.weights[b, :, : r - 10, :n]
            assert_close(part, want_w[0, [3, 0], 10:r], what=f"{name} row {b} narrowed weights")


@pytest.mark.parametrize("name", [*HF_NAMES, "minilm3"])
def test_session_steps_equal_the_attention_module(served, name):
    """Prefill, single-token decode steps and a chunk, past the windowed layers' windows,
    then a fork and a truncate back inside the window: each step's output and weights
    equal transformers' causal attention over the whole prefix (positions continue from the
    cached length; cached K is stored rotated). MiniLM runs causally here (BERT as a
    decoder), the only way a KV cache is exact."""
    client, models = served
    family, base, layer = reference(models, name)
    E = base.config.hidden_size
    x = torch.randn(30, E, generator=torch.Generator().manual_seed(2))

    def want(upto):
        out, w = _causal_reference(family, base, layer, x[None, :upto])
        return out[0], w[0]

    with client.create_session(name) as s:
        cuts = [0, 9, 10, 11, 12, 20, 21, 22]
        for a, b in itertools.pairwise(cuts):
            r = s.step(x[a:b].numpy(), weights=True)
            out, w = want(b)
            assert_close(r.output, out[a:b], what=f"{name} step [{a}, {b}) output")
            assert_close(r.weights, w[:, a:b, :b], what=f"{name} step [{a}, {b}) weights")
        with s.fork() as child:
            r = child.step(x[22:25].numpy())
            assert_close(r.output, want(25)[0][22:25], what=f"{name} fork output")
        s.truncate(21)  # back inside what a window of 6 still holds (test_window_sessions)
        r = s.step(x[21:30].numpy())
        assert_close(r.output, want(30)[0][21:30], what=f"{name} after truncate")


def _causal_reference(family, base, layer, x):
    if family != "bert":
        return reference_attention(family, base, layer, x)
    attention = base.encoder.layer[layer].attention
    with torch.no_grad():
        context, weights = attention.self(x, attention_mask=causal_mask(x.shape[1]))[:2]
        return attention.output.dense(context), weights


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_full"])
def test_sinks_over_many_scores_equal_transformers(served, name):
    """GPT-OSS's sinks over SINKS_BY_SDPA_MIN_SCORES scores per head run through SDPA's
    fused kernel and its logsumexp (model/cached.py: sinks_by_sdpa), not the explicit kernel
    the shorter tests above reach: a padded batch of 128 and 120 tokens (the sliding layer's
    window cut), and a session's 128-token prompt then a 128-token chunk, equal
    transformers' GptOssAttention."""
    from mha_serve.model.cached import SINKS_BY_SDPA_MIN_SCORES

    client, models = served
    family, base, layer = reference(models, name)
    E = base.config.hidden_size
    x = torch.randn(2, 256, E, generator=torch.Generator().manual_seed(3))
    lengths = [128, 120]
    assert 120 * 120 < SINKS_BY_SDPA_MIN_SCORES <= 128 * 128  # (the padded batch's: 128)
    got = client.attend(name, x[:, :128].numpy(), lengths=lengths)
    for b, n in enumerate(lengths):
        want, _ = reference_attention(family, base, layer, x[b : b + 1, :n])
        assert_close(got.output[b, :n], want[0], what=f"{name} row {b} output")
    want, _ = reference_attention(family, base, layer, x[:1])
    with client.create_session(name) as s:
        assert_close(s.step(x[0, :128].numpy()).output, want[0, :128], what=f"{name} prompt")
        assert_close(s.step(x[0, 128:].numpy()).output, want[0, 128:], what=f"{name} chunk")

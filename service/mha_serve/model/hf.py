"""One layer's attention of a Hugging Face model directory as a MultiHeadAttention: the
family's tensors (safetensors only, never pickle) mapped onto our fused [Wq; Wk; Wv] and wo.

What is served, per family (transformers' module names):
  bert     BertSelfAttention (query/key/value) + BertSelfOutput.dense; the LayerNorm and
           residual after it are not attention and are not applied
  gpt2     GPT2Attention: c_attn (Conv1D, weight (E, 3E), transposed here) and c_proj
  gpt_bigcode  GPTBigCodeAttention (StarCoder 1, SantaCoder): c_attn (a Linear: [q; k; v] with
           multi_query, one KV head; else rows per head, regrouped here) and c_proj, biases
  bloom    BloomAttention: query_key_value (rows per head, as GPT-NeoX's; regrouped here)
           and dense, both with biases; ALiBi; its residual (added inside the module) is
           not attention and is not applied
  gptj     GPTJAttention: q_proj/k_proj/v_proj and out_proj, no biases; partial RoPE by
           interleaved pairs (rotary_dim of each head)
  codegen  CodeGenAttention: GPT-J's with one qkv_proj whose rows are 4 groups (mp_num), each
           [q; v; k] of a quarter of the heads (regrouped here) and out_proj
  mpt      MptAttention (MPT-7B, 30B): Wqkv (rows [q; k; v] already, as ours) and out_proj,
           no biases; ALiBi
  gpt_neox GPTNeoXAttention: query_key_value (its rows per head: q, k, v of head 0, then of
           head 1, ...; regrouped here) and dense, both with biases by attention_bias;
           partial RoPE by halves (rotary_pct)
  falcon   FalconAttention: query_key_value (rows per KV head: its query heads, k, v;
           regrouped here: GQA with new_decoder_architecture, MQA with multi_query, else
           MHA) and dense, both with biases by bias; RoPE, or with alibi (Falcon-RW) ALiBi
           in its form (bfloat16 slope * position, scaled by 1 / sqrt(head_dim))
  phi      PhiAttention (Phi-1, 1.5, 2): q_proj/k_proj/v_proj and dense, all with biases;
           partial RoPE by halves (partial_rotary_factor, 0.5 by default)
  stablelm StableLmAttention (StableLM 2, StableLM-3B): as Llama; q/k/v biases by
           use_qkv_bias (o_proj none: a zero bias); partial RoPE by halves (0.25)
  nemotron NemotronAttention (Nemotron-3, Nemotron-4, Minitron): as Llama (q/k/v/o biases by
           attention_bias, head_dim of its own); partial RoPE by halves (0.5 by default)
  deepseek_v2, deepseek_v3, glm4_moe_lite, minicpm3, youtu, axk1
           DeepseekV2/V3Attention and theirs (multi-head latent attention): q_a_proj,
           q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
           and o_proj as they are, the module's MLA (an MQA layer over one latent per token)
  bailing_hybrid
           BailingHybridAttention (Ling 3.0's MLA layers; its KDA layers refused): DeepSeek's
           MLA with q_proj (no q latent), and g_proj (one row per head) as the module's
           per-head output gate on each head's output after its W_uv
  qwen3_next, qwen3_5(_text), qwen3_5_moe(_text)
           Qwen3NextAttention, Qwen3_5Attention (their full_attention layers; the others are
           linear attention, refused): as Qwen3's, but q_proj's rows per head [query; gate],
           split here into wqkv's query rows and wgate (the module's output gate); their
           q/k norm's gain is 1 + weight (folded in here); partial RoPE by halves
  gemma3n(_text), gemma4(_text), gemma4_unified(_text)
           Gemma3nTextAttention, Gemma4TextAttention, Gemma4UnifiedTextAttention: as Llama's
           with q_norm/k_norm (gain: weight) and a value norm (v_norm, no gain, no tensor);
           Gemma 4's global layers with attention_k_eq_v have no v_proj: k_proj's rows serve
           as the value rows too (v = v_norm(k_proj(x)))
  nemotron_h, recurrent_gemma
           NemotronHAttention (layers.{i}.mixer), RecurrentGemmaAttention
           (layers.{i}.temporal_block): q_proj/k_proj/v_proj/o_proj as Llama's, on their
           attention layers (the hybrids' others are refused: hf_families.HYBRIDS)
  afmoe    AfmoeAttention: as Llama's with Qwen3's q/k norm, and gate_proj (hf_families.OWN_GATE:
           an output gate of its own projection, per dim) read as the module's wgate (a zero
           bias beside biased projections); NoPE global layers
  beam     BeamAttention (its layers with a RoPE table): as AFMoE's, its gate's bias gate_bias
           (one per head) over each head's dims; q/k/v/o without biases take zero ones
  lfm3     Lfm3Attention (its sliding and full layers): as AFMoE's, its gate gate_proj on disk
           (g_proj in transformers), one row per head: the module's per-head output gate; its
           full layers' proportional RoPE
  llama, mistral, qwen2, qwen3, olmo2, gemma2, gemma3(_text), phi3, gpt_oss and the families whose
  attention is one of theirs (hf_families.FAMILIES: Mixtral, Qwen-MoE, OLMoE, Granite, ...)
           q_proj/k_proj/v_proj/o_proj (Phi-3: one qkv_proj) with GQA (num_key_value_heads)
           and RoPE applied to q and k; Qwen2's q/k/v biases (its o_proj has none: served as
           a zero bias); q_norm/k_norm (Qwen3, OLMo-2, Gemma 3: Gemma's gain is 1 + weight,
           folded in here); GPT-OSS's sinks (a logit per query head, a tensor without
           .weight); sliding windows, scales and soft-capping are config only. MoE
           checkpoints: only the attention tensors are read
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .attention import MultiHeadAttention
from .checks import check_sinks
from .hf_config import HFLayer, read_hf_layer
from .hf_families import CODEGEN_GROUPS, OUTPUT_GATE, OWN_GATE

# Per family: the attention tensors of layer {i}, without the checkpoint's own prefix
# ("bert.", "transformer.", "model." or none, found from the file).
_NAMES = {
    "bert": {
        "q": "encoder.layer.{i}.attention.self.query",
        "k": "encoder.layer.{i}.attention.self.key",
        "v": "encoder.layer.{i}.attention.self.value",
        "o": "encoder.layer.{i}.attention.output.dense",
    },
    "gpt2": {"qkv": "h.{i}.attn.c_attn", "o": "h.{i}.attn.c_proj"},
    "gpt_bigcode": {"qkv": "h.{i}.attn.c_attn", "o": "h.{i}.attn.c_proj"},
    "gptj": {
        "q": "h.{i}.attn.q_proj",
        "k": "h.{i}.attn.k_proj",
        "v": "h.{i}.attn.v_proj",
        "o": "h.{i}.attn.out_proj",
    },
    "rotary": {
        "q": "layers.{i}.self_attn.q_proj",
        "k": "layers.{i}.self_attn.k_proj",
        "v": "layers.{i}.self_attn.v_proj",
        "o": "layers.{i}.self_attn.o_proj",
    },
    "phi3": {"qkv": "layers.{i}.self_attn.qkv_proj", "o": "layers.{i}.self_attn.o_proj"},
    "codegen": {"qkv": "h.{i}.attn.qkv_proj", "o": "h.{i}.attn.out_proj"},
    "mpt": {"qkv": "blocks.{i}.attn.Wqkv", "o": "blocks.{i}.attn.out_proj"},
    "gpt_neox": {"qkv": "layers.{i}.attention.query_key_value", "o": "layers.{i}.attention.dense"},
    "falcon": {"qkv": "h.{i}.self_attention.query_key_value", "o": "h.{i}.self_attention.dense"},
    "bloom": {
        "qkv": "h.{i}.self_attention.query_key_value",
        "o": "h.{i}.self_attention.dense",
    },
    **dict.fromkeys(
        ("lfm2", "lfm2_moe"),
        {
            "q": "layers.{i}.self_attn.q_proj",
            "k": "layers.{i}.self_attn.k_proj",
            "v": "layers.{i}.self_attn.v_proj",
            "o": "layers.{i}.self_attn.out_proj",
        },
    ),
    "nemotron_h": {  # (NemotronHBlock's mixer: its attention on the attention layers)
        "q": "layers.{i}.mixer.q_proj",
        "k": "layers.{i}.mixer.k_proj",
        "v": "layers.{i}.mixer.v_proj",
        "o": "layers.{i}.mixer.o_proj",
    },
    "recurrent_gemma": {  # (its decoder layer's temporal_block, on the attention layers)
        "q": "layers.{i}.temporal_block.q_proj",
        "k": "layers.{i}.temporal_block.k_proj",
        "v": "layers.{i}.temporal_block.v_proj",
        "o": "layers.{i}.temporal_block.o_proj",
    },
    "mla": {
        "q_a": "layers.{i}.self_attn.q_a_proj",
        "q_a_norm": "layers.{i}.self_attn.q_a_layernorm",
        "q_b": "layers.{i}.self_attn.q_b_proj",
        "q": "layers.{i}.self_attn.q_proj",
        "kv_a": "layers.{i}.self_attn.kv_a_proj_with_mqa",
        "kv_a_norm": "layers.{i}.self_attn.kv_a_layernorm",
        "kv_b": "layers.{i}.self_attn.kv_b_proj",
        "o": "layers.{i}.self_attn.o_proj",
    },
    # (Ling 3.0's names on disk, as its checkpoints and save_pretrained write them:
    # transformers renames attention to self_attn and dense to o_proj when it loads them)
    "bailing_hybrid": {
        "q": "layers.{i}.attention.q_proj",
        "kv_a": "layers.{i}.attention.kv_a_proj_with_mqa",
        "kv_a_norm": "layers.{i}.attention.kv_a_layernorm",
        "kv_b": "layers.{i}.attention.kv_b_proj",
        "o": "layers.{i}.attention.dense",
    },
    "phi": {
        "q": "layers.{i}.self_attn.q_proj",
        "k": "layers.{i}.self_attn.k_proj",
        "v": "layers.{i}.self_attn.v_proj",
        "o": "layers.{i}.self_attn.dense",
    },
}
# Families whose one fused q/k/v projection has its rows per KV head: each KV head's query
# heads, then its key, then its value (grouped_rows).
_GROUPED = ("gpt_neox", "falcon", "gpt_bigcode", "bloom")
# q/k RMSNorm weights, beside the projections of the rotary families that have them.
_NORM_NAMES = {"q_norm": "layers.{i}.self_attn.q_norm", "k_norm": "layers.{i}.self_attn.k_norm"}
# Families whose q/k norms have other names (LFM2's q_layernorm, k_layernorm: RMSNorms).
_OWN_NORM_NAMES = {
    **dict.fromkeys(
        ("lfm2", "lfm2_moe"),
        {
            "q_norm": "layers.{i}.self_attn.q_layernorm",
            "k_norm": "layers.{i}.self_attn.k_layernorm",
        },
    ),
    **dict.fromkeys(  # (Hunyuan v1's query_layernorm, key_layernorm: RMSNorms after RoPE)
        ("hunyuan_v1_dense", "hunyuan_v1_moe"),
        {
            "q_norm": "layers.{i}.self_attn.query_layernorm",
            "k_norm": "layers.{i}.self_attn.key_layernorm",
        },
    ),
}
# GPT-OSS's attention sinks (H,): a bare tensor, no .weight/.bias suffix.
_SINKS_NAME = "layers.{i}.self_attn.sinks"
# Families whose norm scales by 1 + weight (Gemma3RMSNorm, Qwen3NextRMSNorm), not by weight.
_OFFSET_NORMS = ("gemma3", "gemma3_text", *OUTPUT_GATE, "qwen3_5", "qwen3_5_moe")


def load_hf_layer(
    directory: str | Path,
    layer: int | None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[MultiHeadAttention, HFLayer]:
    """The attention of `layer` in DIR (config.json + model.safetensors or shards with
    model.safetensors.index.json), in eval mode; dtype None keeps the checkpoint's."""
    info = read_hf_layer(directory, layer)
    c = info.attention
    if c.mla is not None:
        return _load_mla(info, device, dtype), info
    names = _NAMES["rotary" if info.family not in _NAMES else info.family]
    if c.qk_norm is not None and c.qk_norm.gain:
        names = {**names, **_OWN_NORM_NAMES.get(info.family, _NORM_NAMES)}
    own_gate = OWN_GATE.get(info.family) if c.output_gate else None
    if own_gate is not None:  # (AFMoE's gate_proj, ...: a projection beside q_proj)
        names = {**names, "gate": "layers.{i}.self_attn." + own_gate[0]}
    names = {k: v.format(i=info.layer) for k, v in names.items()}
    sinks_name = _SINKS_NAME.format(i=info.layer) if c.sinks else None
    bare = [sinks_name] if sinks_name else []
    if own_gate is not None and own_gate[2] is not None:  # (its bias, one value per head)
        bare.append(f"layers.{info.layer}.self_attn.{own_gate[2]}")
    tensors = _read(info.directory, names, info, bare)
    E, H, KVH, D = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim
    if info.family == "gpt2":  # Conv1D stores (in, out): x @ W + b
        w = _get(tensors, names["qkv"] + ".weight", (E, 3 * E)).t()
        b = _get(tensors, names["qkv"] + ".bias", (3 * E,))
        wo = _get(tensors, names["o"] + ".weight", (E, E)).t()
        bo = _get(tensors, names["o"] + ".bias", (E,))
    elif info.family in ("phi3", "mpt"):  # rows [q; k; v] already, as our wqkv (no biases)
        w = _get(tensors, names["qkv"] + ".weight", (c.qkv_dim, E))
        wo = _get(tensors, names["o"] + ".weight", (E, H * D))
        b = bo = None
    elif info.family == "codegen":  # rows [q_g; v_g; k_g] per group g of H / 4 heads
        # (CodeGenAttention reshapes qkv (..., 4, 3E / 4) and splits q, v, k): regrouped
        w = _get(tensors, names["qkv"] + ".weight", (3 * E, E))
        w = w.view(CODEGEN_GROUPS, 3, E // CODEGEN_GROUPS, E)  # (group, q/v/k, its rows, E)
        w = torch.cat([w[:, part].reshape(E, E) for part in (0, 2, 1)])  # [Wq; Wk; Wv]
        wo = _get(tensors, names["o"] + ".weight", (E, E))
        b = bo = None
    elif info.family in _GROUPED:  # one fused projection, rows per KV head: regrouped
        rows = grouped_rows(H, KVH, D)
        w = _get(tensors, names["qkv"] + ".weight", (c.qkv_dim, E))[rows]
        wo = _get(tensors, names["o"] + ".weight", (E, H * D))
        b = bo = None
        if c.bias:
            b = _get(tensors, names["qkv"] + ".bias", (c.qkv_dim,))[rows]
            bo = _get(tensors, names["o"] + ".bias", (E,))
    else:
        shapes = {"q": (H * D, E), "k": (KVH * D, E), "v": (KVH * D, E), "o": (E, H * D)}
        in_q = c.output_gate and own_gate is None  # (Qwen3-Next's: in q_proj's rows)
        if in_q:  # q_proj's rows per head [query (D); gate (D)]: split below
            shapes["q"] = (2 * H * D, E)
        # Gemma 4's attention_k_eq_v (global layers): no v_proj, the values are k_proj's
        # output (normed by v_norm, not k_norm, and not rotated): its rows serve as both
        parts = "qko" if info.values_from_keys else "qkvo"
        got = {p: _get(tensors, names[p] + ".weight", shapes[p]) for p in parts}
        if info.values_from_keys:
            got["v"] = got["k"]
        if in_q:
            got["q"], gate = _split_gate(got["q"], H, D)
        w = torch.cat([got[p] for p in "qkv"])
        wo = got["o"]
        b = bo = None
        if c.bias:
            for p in info.zero_biases:  # Qwen2's o_proj has none
                tensors.setdefault(names[p] + ".bias", torch.zeros(shapes[p][0], dtype=wo.dtype))
            got = {p: _get(tensors, names[p] + ".bias", shapes[p][:1]) for p in parts[:-1]}
            if info.values_from_keys:
                got["v"] = got["k"]
            if in_q:
                got["q"], gate_bias = _split_gate(got["q"], H, D)
            b = torch.cat([got[p] for p in "qkv"])
            bo = _get(tensors, names["o"] + ".bias", (E,))
    state = {"wqkv.weight": w, "wo.weight": wo}
    if c.bias:
        state.update({"wqkv.bias": b, "wo.bias": bo})
    if own_gate is not None:
        gate, gate_bias = _own_gate(tensors, names["gate"], own_gate, info)
    if c.output_gate:
        state["wgate.weight"] = gate
        if c.bias:
            state["wgate.bias"] = gate_bias
    if c.qk_norm is not None and c.qk_norm.gain:
        whole = c.qk_norm.scope == "projection"
        for key, heads in (("q_norm", H), ("k_norm", KVH)):
            gain = _get(tensors, names[key] + ".weight", ((heads if whole else 1) * D,))
            if info.family in _OFFSET_NORMS:  # in float32, as Gemma3RMSNorm: 1.0 + w.float()
                gain = 1.0 + gain.float()
            state[key] = gain
    if sinks_name is not None:
        state["sinks"] = _get(tensors, sinks_name, (H,))
    if dtype is None:
        dtype = w.dtype
    module = MultiHeadAttention(c, device=device, dtype=dtype)
    # load_state_dict copies into the module's dtype: a float32 Gemma gain 1 + w is rounded
    # once, where transformers rounds the product instead (equal in float32).
    module.load_state_dict({k: t.contiguous() for k, t in state.items()})
    check_sinks(module.sinks, f"checkpoint tensor {sinks_name!r}")
    return module.eval(), info


def _load_mla(
    info: HFLayer, device: torch.device | str | None, dtype: torch.dtype | None
) -> MultiHeadAttention:
    """An MLA layer's tensors as they are (config.MLAConfig's state dict is theirs, renamed):
    q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj and o_proj; biases on q_a_proj, kv_a_proj_with_mqa and o_proj by attention_bias
    (q_proj has none: served as a zero bias)."""
    c, m = info.attention, info.attention.mla
    E, H, C, R = c.embed_dim, c.num_heads, m.kv_lora_rank, m.rope_dim
    QK = H * (m.nope_dim + R)
    names = {k: v.format(i=info.layer) for k, v in _NAMES.get(info.family, _NAMES["mla"]).items()}
    if m.q_lora_rank is None:
        shapes = {"q": (QK, E)}
    else:
        Q = m.q_lora_rank
        shapes = {"q_a": (Q, E), "q_a_norm": (Q,), "q_b": (QK, Q)}
    shapes.update(
        {"kv_a": (C + R, E), "kv_a_norm": (C,), "kv_b": (H * (m.nope_dim + m.v_head_dim), C)}
    )
    shapes["o"] = (E, H * m.v_head_dim)
    names = {k: names[k] for k in shapes}
    own_gate = OWN_GATE.get(info.family) if c.output_gate else None
    if own_gate is not None:  # (Ling 3.0's g_proj, one row per head, beside kv_a)
        names["gate"] = names["kv_a"].rpartition(".")[0] + "." + own_gate[0]
    tensors = _read(info.directory, names, info, [])
    state = {}
    for part, shape in shapes.items():
        state["wo" if part == "o" else part] = _get(tensors, names[part] + ".weight", shape)
    state = {k if k.endswith("_norm") else k + ".weight": t for k, t in state.items()}
    if c.bias:
        for part in ("q_a" if m.q_lora_rank is not None else "q", "kv_a", "o"):
            rows = shapes[part][0]
            if part == "q":  # (DeepSeek's q_proj: no bias, whatever attention_bias says)
                tensors.setdefault(names["q"] + ".bias", torch.zeros(rows))
            bias = _get(tensors, names[part] + ".bias", (rows,))
            state[("wo" if part == "o" else part) + ".bias"] = bias
    if own_gate is not None:
        gate, gate_bias = _own_gate(tensors, names["gate"], own_gate, info)
        state["wgate.weight"] = gate
        if c.bias:
            state["wgate.bias"] = gate_bias
    if dtype is None:
        dtype = state["kv_a.weight"].dtype
    module = MultiHeadAttention(c, device=device, dtype=dtype)
    module.load_state_dict({k: t.contiguous() for k, t in state.items()})
    return module.eval()


def _own_gate(
    tensors: dict[str, torch.Tensor],
    name: str,
    own_gate: tuple[str, bool, str | None],
    info: HFLayer,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An output gate of its own projection (hf_families.OWN_GATE): its weight (gate_width,
    E), and its bias where the module has one: the family's per-head bias repeated over
    each head's dims, or zeros for a gate without one (AFMoE's, beside biased projections)."""
    c = info.attention
    weight = _get(tensors, name + ".weight", (c.gate_width, c.embed_dim))
    if not c.bias:
        return weight, None
    if own_gate[2] is None:
        return weight, torch.zeros(c.gate_width, dtype=weight.dtype)
    bias_name = f"layers.{info.layer}.self_attn.{own_gate[2]}"
    bias = _get(tensors, bias_name, (c.num_heads,))  # (H,): one per head, over its dims
    return weight, bias.repeat_interleave(c.gate_width // c.num_heads)


def _split_gate(t: torch.Tensor, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated q_proj's weight (2 H D, E) or bias (2 H D,), rows per head [query; gate]
    (Qwen3NextAttention views its output (..., H, 2 D) and chunks it in two), as the
    queries' rows (H D, ...) and the gate's (H D, ...), each head's in order."""
    per_head = t.reshape(H, 2, D, *t.shape[1:])  # (H, query | gate, D, ...)
    return per_head[:, 0].reshape(H * D, *t.shape[1:]), per_head[:, 1].reshape(H * D, *t.shape[1:])


def grouped_rows(num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Where our [Wq; Wk; Wv]'s rows are in a fused projection laid out per KV head: KV head
    g's H / KVH query heads, then its key, then its value, for g = 0..KVH-1. That is
    FalconAttention's view (..., KVH, H / KVH + 2, D) in all three of its layouts (new decoder
    architecture: GQA; multi_query: one group, [q_0..q_H-1; k; v]; else one group per head)
    and GPTNeoXAttention's (..., H, 3 * D): [q_h; k_h; v_h] per head, MHA (BloomAttention's too); GPTBigCodeAttention's
    (multi_query: [q; k; v], one group; else (..., H, 3 * D), as GPT-NeoX)."""
    G = num_heads // num_kv_heads  # query heads per KV head
    rows = torch.arange((num_heads + 2 * num_kv_heads) * head_dim)
    rows = rows.view(num_kv_heads, G + 2, head_dim)  # (KVH, G + 2, D): a group's q.., k, v
    # q head h = g * G + j uses KV head g = h // G, as our GQA (and Falcon's broadcast) does
    return torch.cat([rows[:, :G].reshape(-1), rows[:, G].reshape(-1), rows[:, G + 1].reshape(-1)])


def _read(
    directory: Path, names: dict[str, str], info: HFLayer, bare: list[str]
) -> dict[str, torch.Tensor]:
    """The tensors whose names end with one of names' values (+ .weight/.bias) or of bare's
    (as they are), unprefixed."""
    files = _safetensors_files(directory)
    wanted = {n + s for n in names.values() for s in (".weight", ".bias")} | set(bare)
    scope = info.tensor_scope and info.tensor_scope + "."
    found: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    if scope and scope not in key:  # a vision tower's layers, say
                        continue
                    for name in wanted:
                        if key == name or key.endswith("." + name):
                            if name in found:
                                raise ValueError(
                                    f"{directory}: tensor {name!r} is present twice "
                                    f"(prefixed differently, e.g. {key!r})"
                                )
                            found[name] = f.get_tensor(key)
        except SafetensorError as e:
            raise ValueError(f"{path} is not a valid safetensors file: {e}") from None
    if not any(n + ".weight" in found for n in names.values()):
        raise ValueError(
            f"{directory}: no attention tensors of layer {info.layer} found for "
            f"{info.family} (looked for {sorted(wanted)[:2]}...) in {[p.name for p in files]}"
        )
    return found


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(
            p.name for p in directory.glob("*.pt*")
        )
        raise ValueError(
            f"{directory} has no *.safetensors file{f' (only {pickles})' if pickles else ''}: "
            "only safetensors is loaded, never pickle; convert a trusted checkpoint with "
            "transformers' save_pretrained(..., safe_serialization=True)"
        )
    return files


def _get(
    tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], shown: str | None = None
) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise ValueError(f"checkpoint is missing tensor {shown or name!r} (expected shape {shape})")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"checkpoint tensor {shown or name!r} has shape {tuple(t.shape)}, expected {shape}"
        )
    if not t.is_floating_point():
        raise ValueError(
            f"checkpoint tensor {shown or name!r} has dtype {t.dtype}, expected a float"
        )
    return t

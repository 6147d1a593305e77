"""config.json keys set to null, as checkpoints on the Hub sometimes write them, for every
family and every key we read: transformers 5 (its config class, its model built and run over
a short input) is the judge. What it runs is served exactly (its layer's output, caught on
the real model, against ours); what it builds no layer from is refused, naming the key."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, BertConfig, BertModel
from transformers.models.bloom.modeling_bloom import BloomAttention

from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.reference import CHECKPOINTS, reference_attention

# Every top-level key our reader takes from config.json: all families', then the rotary
# families', GPT-2's, BERT's, Falcon's and GPT-BigCode's own.
KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "max_position_embeddings")
OWN_KEYS = {
    "rotary": (
        *("num_key_value_heads", "head_dim", "rope_theta", "rope_parameters", "rope_scaling"),
        *("rope_local_base_freq", "original_max_position_embeddings", "partial_rotary_factor"),
        *("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"),
        *("sliding_window_pattern", "attention_bias", "qkv_bias", "use_bias"),
        *("attention_out_bias", "query_pre_attn_scalar", "attention_multiplier"),
        *("attn_logit_softcapping", "rms_norm_eps", "no_rope_layers", "no_rope_layer_interval"),
        *("clip_qkv", "use_bidirectional_attention", "attention_chunk_size"),
        *("rotary_pct", "rotary_emb_base", "qk_layernorm", "use_qkv_bias"),  # (GPT-NeoX's, ...)
        *("use_qk_norm", "norm_eps", "full_attn_idxs", "rotary_dim"),  # (GLM-4-MoE's, LFM2's, ...)
    ),
    "gpt2": (
        *("n_embd", "n_head", "n_layer", "n_positions", "scale_attn_weights"),
        *("scale_attn_by_inverse_layer_idx", "add_cross_attention"),
    ),
    "bert": ("is_decoder", "add_cross_attention", "position_embedding_type"),
    "gpt_bigcode": (
        *("n_embd", "n_head", "n_layer", "n_positions", "scale_attn_weights"),
        *("add_cross_attention", "multi_query", "attention_softmax_in_fp32"),
        *("scale_attention_softmax_in_fp32", "attn_pdrop", "resid_pdrop", "head_dim"),
        "num_key_value_heads",
    ),
    "falcon": (
        *("num_kv_heads", "new_decoder_architecture", "multi_query", "alibi", "bias"),
        *("attention_dropout", "head_dim", "rotary", "n_embed", "rope_theta", "rope_parameters"),
        *("rope_scaling", "partial_rotary_factor"),
    ),
    "bloom": ("n_embed", "n_head", "n_layer", "pretraining_tp", "slow_but_exact"),
    # GPT-J's sizes by GPT-2's names, its rotary_dim; and Llama's keys, which GPTJConfig and
    # GPTJAttention never read (their null is no refusal)
    "gptj": (
        *("n_embd", "n_head", "n_layer", "n_positions", "rotary_dim", "rope_theta"),
        *("rope_parameters", "partial_rotary_factor", "head_dim", "rms_norm_eps"),
        "num_key_value_heads",
    ),
    "mpt": (
        *("d_model", "n_heads", "n_layers", "max_seq_len", "no_bias", "attn_config"),
        *(f"attn_config.{key}" for key in ("attn_type", "attn_pdrop", "attn_impl", "clip_qkv")),
        *(f"attn_config.{key}" for key in ("softmax_scale", "prefix_lm", "qk_ln", "alibi")),
        *(f"attn_config.{key}" for key in ("alibi_bias_max", "attn_uses_sequence_id")),
    ),
}
# The MLA families: Llama's keys (most of which they never read) and their latents' sizes
OWN_KEYS.update(
    dict.fromkeys(
        ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "youtu", "axk1"),
        (
            *OWN_KEYS["rotary"],
            *("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"),
            *("v_head_dim", "rope_interleave"),
        ),
    )
)
# (Kimi Linear's context under its own name, and where its layer kinds may come from)
OWN_KEYS["kimi_linear"] = (*OWN_KEYS["axk1"], "model_max_length", "linear_attn_config")
# (the hybrids' keys that say which layers are attention)
OWN_KEYS["jamba"] = (*OWN_KEYS["rotary"], "attn_layer_period", "attn_layer_offset")
OWN_KEYS["bamba"] = (*OWN_KEYS["rotary"], "attn_layer_indices")
OWN_KEYS["nemotron_h"] = (*OWN_KEYS["rotary"], "layers_block_type", "hybrid_override_pattern")
OWN_KEYS["recurrent_gemma"] = (*OWN_KEYS["rotary"], "attention_window_size", "block_types")
OWN_KEYS["granitemoehybrid"] = (*OWN_KEYS["rotary"], "layers_block_type", "position_embedding_type")
# (Ling 3.0's: its context's name, how its config derives a layer's kind, its RoPE theta)
OWN_KEYS["bailing_hybrid"] = (*OWN_KEYS["axk1"], "model_max_length", "layer_group_size")
ABSOLUTE = ("gpt2", "bert", "gpt_bigcode")  # (no RoPE)
OWN_KEYS["codegen"] = OWN_KEYS["gptj"]
# (AFMoE's: how its config derives a layer's kind)
OWN_KEYS["afmoe"] = (*OWN_KEYS["rotary"], "global_attn_every_n_layers")
OWN_KEYS["lfm3"] = (*OWN_KEYS["rotary"], "use_attention_gate")  # (LFM3's gate switch)
OWN_KEYS["beam"] = OWN_KEYS["rotary"]
# Nulls inside the RoPE tables (set only where the key is there), and transformers 4's
# spelling: rope_theta (and Gemma 3's rope_local_base_freq) beside no rope_parameters.
NESTED = (
    "rope_parameters.rope_theta",
    "rope_parameters.rope_type",
    "rope_parameters.factor",
    "rope_parameters.partial_rotary_factor",
    "rope_parameters.full_attention.rope_theta",
    "rope_parameters.sliding_attention.rope_theta",
    "v4.rope_theta",
    "v4.rope_local_base_freq",
)
# Layers transformers runs that we refuse for another reason than the null: the gated
# families' layer 1 without layer_types is linear attention (every 4th layer is full; Ling
# 3.0's every 6th).
REFUSED_OTHERWISE: set[tuple[str, str, int]] = {
    (family, "layer_types", 1)
    for family in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "bailing_hybrid")
} | {  # (Beam's full layer without its RoPE table: BeamConfig's null one, position-scaled)
    ("beam", key, 1) for key in ("rope_parameters", "v4.rope_theta", "v4.rope_local_base_freq")
}
# (Nemotron-H without its list: NemotronHConfig's four blocks, layer 1 an MoE one)
REFUSED_OTHERWISE.add(("nemotron_h", "layers_block_type", 1))
# (MiniMax-01 without layer_types: its layer 1 is a lightning attention one)
REFUSED_OTHERWISE.add(("minimax", "layer_types", 1))

FAMILIES = {name: (cls, config) for name, (cls, config, _) in CHECKPOINTS.items()}
FAMILIES["bert"] = (
    BertModel,
    BertConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=64,
        max_position_embeddings=64,
    ),
)
EDITS = {"qwen2_moe": {"num_experts_per_tok": 1}}  # (its 4 of the checkpoint's 2 experts)
L = 16  # tokens: past every window of the checkpoints (6 to 12)


def with_null(cfg: dict, key: str) -> dict | None:
    """cfg with key (a dotted path into a table) set to null; None where it is not there."""
    cfg = json.loads(json.dumps(cfg))
    if key.startswith("v4."):
        cfg.pop("rope_parameters", None)
        key = key[3:]
    *path, leaf = key.split(".")
    table = cfg
    for part in path:
        if not isinstance(table.get(part), dict):
            return None
        table = table[part]
    if path and leaf not in table:
        return None
    table[leaf] = None
    return cfg


def transformers_runs(cls, directory):
    """transformers' model from config.json, and each layer's attention (input, output) over
    L tokens; or the error with which it builds or runs none."""
    caught = {}
    try:
        config = AutoConfig.from_pretrained(directory)
        torch.manual_seed(0)
        # (Falcon-RW: transformers' eager FalconModel adds the ALiBi twice, in the mask it
        # builds and in FalconAttention; its SDPA path once, as tiiuae's own code)
        rw = config.model_type == "falcon" and getattr(config, "alibi", False) is True
        model = cls._from_config(config, attn_implementation="sdpa" if rw else "eager").eval()
        base = getattr(model, "transformer", None) or getattr(model, "model", None) or model
        blocks = (  # (MPT's: blocks)
            base.h
            if hasattr(base, "h")
            else getattr(base, "layers", None) or getattr(base, "blocks", None) or []
        )
        for i, block in enumerate(blocks):
            # (Nemotron-H's mixer, RecurrentGemma's temporal_block: attention on some blocks)
            mixer = getattr(block, "mixer", None) or getattr(block, "temporal_block", None)
            attention = (  # (GPT-2's attn, GPT-NeoX's attention, Falcon's and BLOOM's self_attention)
                getattr(block, "attn", None)
                or getattr(block, "attention", None)
                or getattr(block, "self_attention", None)
                or getattr(block, "self_attn", None)
                or (mixer if type(mixer).__name__.endswith("Attention") else None)
            )
            if attention is None:  # (a hybrid's other layers: Qwen3-Next's linear attention,
                # LFM2's short convolutions)
                continue
            attention.register_forward_pre_hook(
                lambda m, a, k, i=i: caught.__setitem__(("in", i), (a or [k["hidden_states"]])[0]),
                with_kwargs=True,
            )
            # (BloomAttention adds its residual, its second argument, to its output: not
            # attention, taken off)
            attention.register_forward_hook(
                lambda m, a, out, i=i: caught.__setitem__(
                    ("out", i), out[0] - a[1] if isinstance(m, BloomAttention) else out[0]
                )
            )
        x = torch.randn(1, L, config.hidden_size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            base(inputs_embeds=x)
    except Exception as e:  # (a TypeError, a strict dataclass' validation error, ...)
        return None, caught, f"{type(e).__name__}: {e}"
    return model, caught, None


def served_as_transformers(family, directory, layer, model, caught):
    """Our layer against transformers' (caught on the model as it ran): the largest
    |difference| past 1e-5 of |theirs| (fp32 summed in another order; MLA's absorbed dot
    products most: over its latent, not its expanded heads)."""
    module, _ = load_hf_layer(directory, layer)
    with torch.no_grad():
        if family == "bert":
            x = torch.randn(1, L, 64, generator=torch.Generator().manual_seed(2))
            want = reference_attention("bert", model, layer, x)[0]
        else:
            x, want = caught[("in", layer)], caught[("out", layer)]
        return ((module(x).output - want).abs() - 1e-5 * want.abs()).max().item()


def outputs(model, caught):
    return [v for k, v in sorted(caught.items()) if k[0] == "out"] or [
        p for p in model.state_dict().values()
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_null_is_served_as_transformers_runs_it_or_refused_by_name(tmp_path, family):
    cls, config = FAMILIES[family]
    base = tmp_path / "base"
    config.save_pretrained(base)
    original = {**json.loads((base / "config.json").read_text()), **EDITS.get(family, {})}
    (base / "config.json").write_text(json.dumps(original))
    model, caught, error = transformers_runs(cls, base)
    assert error is None, error
    model.save_pretrained(base)
    (base / "config.json").write_text(json.dumps(original))
    theirs = outputs(model, caught)
    ours = {}
    for layer in (0, 1):
        try:
            ours[layer] = replace(read_hf_layer(base, layer), directory=None)
        except ValueError:  # (Cohere 2's local layer)
            continue
        assert served_as_transformers(family, base, layer, model, caught) < 1e-5
    wrong = []
    own = OWN_KEYS.get(config.model_type, OWN_KEYS["rotary"])
    if config.model_type not in ABSOLUTE:  # (the RoPE tables' keys)
        own += NESTED
    for key in KEYS + own:
        cfg = with_null(original, key)
        if cfg is None:
            continue
        directory = tmp_path / key
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(cfg))
        model, caught, error = transformers_runs(cls, directory)
        name = key.split(".")[-1]
        for layer in (0, 1):
            try:
                read = replace(read_hf_layer(directory, layer), directory=None)
                refused = None
            except ValueError as e:
                read, refused = None, str(e)
            if error is not None:
                if refused is None or name not in refused:
                    wrong.append(
                        f"{key} layer {layer}: served, or refused not naming {name} "
                        f"({refused}), where transformers fails: {error[:200]}"
                    )
            elif refused is not None:
                if (family, key, layer) not in REFUSED_OTHERWISE and layer in ours:
                    wrong.append(f"{key} layer {layer}: refused where transformers runs: {refused}")
            elif read != ours.get(layer) or not all(
                a.shape == b.shape and torch.equal(a, b)
                for a, b in zip(outputs(model, caught), theirs, strict=True)
            ):  # (else the null changed nothing, here or there: the base's parity holds)
                if not (directory / "model.safetensors").exists():
                    model.save_pretrained(directory)
                    (directory / "config.json").write_text(json.dumps(cfg))  # (nulls kept)
                diff = served_as_transformers(family, directory, layer, model, caught)
                if not diff < 1e-5:
                    wrong.append(f"{key} layer {layer}: served off transformers' by {diff:.3g}")
    assert not wrong, f"{family}:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("family", "edits", "piece"),
    [
        # transformers 4's spelling with rope_theta null: 5's rotary embedding computes
        # None ** ...; we served theta 10000 (Mixtral's default is 1e6, and that is not
        # what transformers runs either)
        (
            "mixtral",
            {"rope_parameters": None, "rope_theta": None},
            "mixtral config.json sets rope_theta to null",
        ),
        # Qwen2's attention scales by head_dim ** -0.5 as its config has it: no fallback
        ("qwen2", {"head_dim": None}, "qwen2 config.json sets head_dim to null"),
        # Gemma 2 masks its local layers by the window: no model without one, so its
        # global layers are refused too
        ("gemma2", {"sliding_window": None}, "(layer 0 is a sliding_attention layer)"),
        # GPT-NeoX's config puts its rotary_pct and rotary_emb_base into the RoPE table as
        # they are: its attention computes int(head_size * None), its rotary embedding
        # None ** ... (a partial_rotary_factor null elsewhere is dropped: every dim rotates)
        *[
            ("gpt_neox", {"rope_parameters": None, key: None}, f"gpt_neox config.json sets {key}")
            for key in ("rotary_pct", "rotary_emb_base")
        ],
        # Phi's, StableLM's and Nemotron's configs drop a null partial_rotary_factor, and
        # their attention reads it from the RoPE table (KeyError)
        *[
            (
                family,
                {"rope_parameters": None, "partial_rotary_factor": None},
                f"{family} config.json sets partial_rotary_factor to null",
            )
            for family in ("phi", "stablelm", "nemotron")
        ],
    ],
    ids=[
        *("mixtral_rope_theta", "qwen2_head_dim", "gemma2_sliding_window"),
        *("gpt_neox_rotary_pct", "gpt_neox_rotary_emb_base", "phi_partial_rotary_factor"),
        *("stablelm_partial_rotary_factor", "nemotron_partial_rotary_factor"),
    ],
)
def test_a_null_transformers_builds_no_layer_from_is_refused_naming_key_and_family(
    tmp_path, family, edits, piece
):
    cls, config = FAMILIES[family]
    config.save_pretrained(tmp_path)
    cfg = {**json.loads((tmp_path / "config.json").read_text()), **edits}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert transformers_runs(cls, tmp_path)[2] is not None  # (transformers builds none)
    for layer in (0, 1):
        with pytest.raises(ValueError) as err:
            read_hf_layer(tmp_path, layer)
        assert piece in str(err.value) and "to the checkpoint's" in str(err.value), err.value

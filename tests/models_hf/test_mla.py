"""The multi-head latent attention families (DeepSeek-V2 and V3, Kimi K2, GLM-4.7-Flash,
MiniCPM3, Youtu-LLM, A.X-K1; Kimi Linear's MLA layers, without RoPE): config.json read as their config classes read it, each variant of the layer
(q through its latent or not, RoPE by pairs or by halves, YaRN's softmax factor, biases)
served equal to transformers' own attention from the same directory, and what transformers
builds no layer from, or computes otherwise, refused by name. (The reference checkpoints'
parity over gRPC, sessions and incremental decode are test_parity_grpc's and
test_sessions_cache's; their nulls test_config_nulls'.)"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import (
    AXK1Config,
    AXK1Model,
    DeepseekV2Config,
    DeepseekV2Model,
    DeepseekV3Config,
    DeepseekV3Model,
    Glm4MoeLiteConfig,
    Glm4MoeLiteModel,
    KimiLinearConfig,
    KimiLinearModel,
    MiniCPM3Config,
    MiniCPM3Model,
    YoutuConfig,
    YoutuModel,
)

from mha_serve.engine import Engine
from mha_serve.engine.types import ModelSpec
from mha_serve.model import mla
from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.engine_calls import req, run
from tests.models_hf.reference import (
    CHECKPOINTS,
    MLA,
    MLA_MOE,
    load_reference,
    reference_attention,
    reference_decode,
)
from tests.models_hf.test_config_json import assert_served_as_transformers, checkpoint
from tests.models_hf.test_families import _config_only

YOUTU = {k: v for k, v in MLA.items() if not k.startswith("first_k")}  # (a dense decoder)
# Kimi Linear: a KDA layer, then an MLA one (NoPE); its experts of 2
KIMI = {**MLA, "layer_types": ["linear_attention", "full_attention"], "pad_token_id": None}
KIMI.update({"linear_head_dim": 8, "linear_num_heads": 2, "moe_intermediate_size": 32})
KIMI.update({"num_experts": 2, "num_experts_per_token": 1, "v_head_dim": 12})
V3 = {"q_lora_rank": 24, "v_head_dim": 12, "n_group": 1, "topk_group": 1, **MLA_MOE, **MLA}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 500.0,
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


@pytest.mark.parametrize(
    ("cls", "config", "edits", "layer"),
    [
        # DeepSeek-V3 as config.json writes it, RoPE by pairs, one dense layer then MoE
        (DeepseekV3Model, DeepseekV3Config(**V3), {}, 1),
        # rope_interleave false: by halves (apply_rotary_pos_emb)
        (DeepseekV3Model, DeepseekV3Config(rope_interleave=False, **V3), {}, 0),
        # a null rope_interleave: by halves too (its config types it bool | None)
        (DeepseekV3Model, DeepseekV3Config(**V3), {"rope_interleave": None}, 1),
        # YaRN with mscale_all_dim: the softmax scale times mscale ** 2, the rotation's
        # cos/sin by mscale / mscale_all_dim (1 here), yarn's frequencies over the rope dims
        (DeepseekV3Model, DeepseekV3Config(rope_parameters=YARN, **V3), {}, 1),
        # q_proj (q_lora_rank null) with attention_bias: its q_proj has no bias, kv_a's has
        (
            DeepseekV3Model,
            DeepseekV3Config(attention_bias=True, **{**V3, "q_lora_rank": None}),
            {},
            0,
        ),
        # rms_norm_eps is the decoder's norms' (not served); the latents' norms take 1e-6
        (DeepseekV3Model, DeepseekV3Config(**{**V3, "rms_norm_eps": 2.0}), {}, 1),
        # DeepSeek-V2 with its q latent; RoPE by pairs as complex numbers
        (
            DeepseekV2Model,
            DeepseekV2Config(q_lora_rank=24, v_head_dim=16, attention_bias=True, **MLA_MOE, **MLA),
            {},
            1,
        ),
        # GLM-4.7-Flash's head_dim: another name of qk_rope_head_dim (its attribute_map),
        # which wins: 6 where qk_rope_head_dim says 4
        (
            Glm4MoeLiteModel,
            Glm4MoeLiteConfig(
                q_lora_rank=24,
                v_head_dim=8,
                n_group=1,
                topk_group=1,
                **MLA_MOE,
                **{**MLA, "qk_rope_head_dim": 6},
            ),
            {"head_dim": 6, "qk_rope_head_dim": 4},
            1,
        ),
        # MiniCPM3 without its q latent, v heads of 20 given
        (
            MiniCPM3Model,
            MiniCPM3Config(
                q_lora_rank=None,
                v_head_dim=20,
                **{k: v for k, v in MLA.items() if not k.startswith("first_k")},
            ),
            {},
            1,
        ),
        # Youtu-LLM (DeepseekV3Attention): a null rope_interleave, by halves as V3's
        (
            YoutuModel,
            YoutuConfig(q_lora_rank=24, v_head_dim=12, **YOUTU),
            {"rope_interleave": None},
            1,
        ),
        # A.X-K1: V3's with YaRN's mscale, biases on q_a_proj, kv_a and o_proj, by pairs
        (
            AXK1Model,
            AXK1Config(rope_parameters=YARN, attention_bias=True, **V3),
            {},
            1,
        ),
        # Kimi Linear through its q latent, its layer kinds from linear_attn_config (layers
        # numbered from 1), a RoPE table beside it that its config never reads: no rotation
        (
            KimiLinearModel,
            KimiLinearConfig(q_lora_rank=24, **KIMI),
            {
                "layer_types": None,
                "linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1]},
                "rope_parameters": {"rope_type": "default", "rope_theta": 10.0},
            },
            1,
        ),
    ],
    ids=[
        *("v3", "v3_halves", "v3_interleave_null", "v3_yarn", "v3_q_proj_bias", "v3_norm_eps"),
        *("v2_q_latent", "glm4_moe_lite_head_dim", "minicpm3_q_proj"),
        *("youtu_interleave_null", "axk1_yarn_bias", "kimi_linear_q_latent_nope"),
    ],
)
def test_each_mla_variant_is_served_as_transformers_computes_it(
    tmp_path, cls, config, edits, layer
):
    directory = checkpoint(tmp_path, cls, config)
    if edits:
        path = directory / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **edits}))
    read = read_hf_layer(directory, layer).attention
    assert read.mla is not None and read.num_kv_heads == 1
    assert (read.rope is None) == (config.model_type == "kimi_linear")
    assert read.head_dim == read.mla.rope_dim + read.mla.kv_lora_rank
    assert_served_as_transformers(directory, cls, config.model_type, layer)


def test_the_softmax_scale_is_the_qk_heads_with_yarn_mscale_squared(tmp_path):
    """(8 + 4) ** -0.5 without YaRN (not the served head's (4 + 16) ** -0.5); times
    (0.1 * 0.707 * ln 8 + 1) ** 2 with it, as yarn_apply_mscale."""
    plain = read_hf_layer(_config_only(tmp_path / "a", DeepseekV3Config(**V3)), 0).attention
    assert plain.scale == pytest.approx(12**-0.5)
    yarn = DeepseekV3Config(rope_parameters=YARN, **V3)
    scaled = read_hf_layer(_config_only(tmp_path / "b", yarn), 0).attention
    mscale = 0.1 * 0.707 * math.log(8.0) + 1.0
    assert scaled.scale == pytest.approx(12**-0.5 * mscale**2)
    assert scaled.rope.type == "yarn" and scaled.rope.interleaved


def test_kimi_k2_is_served_as_deepseek_v3(tmp_path):
    """Kimi K2's config.json says model_type kimi_k2 (its code on the Hub is DeepSeek-V3's,
    as Kimi_K25Config reads its text model): served as transformers' DeepseekV3Attention."""
    directory = checkpoint(tmp_path, DeepseekV3Model, DeepseekV3Config(**V3), model_type="kimi_k2")
    info = read_hf_layer(directory, 1)
    assert info.family == "deepseek_v3" and info.attention.mla is not None
    base = DeepseekV3Model.from_pretrained(directory, attn_implementation="eager").eval()
    module, _ = load_hf_layer(directory, 1)
    x = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, want_w = reference_attention("deepseek_v3", base, 1, x)
        got = module(x, need_weights=True)
    torch.testing.assert_close(got.output, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.weights, want_w, atol=1e-5, rtol=1e-5)


def test_a_session_caches_one_latent_per_token_not_the_expanded_heads(hf_dirs):
    """DeepSeek-V3's session holds rope dims + latent values per token (K alone: its values
    are its keys, read back as the same tensor), C + R as transformers 5's own latent cache,
    where its expanded heads would be H x (nope + rope + v): the point of MLA (here 20
    against 4 x 24)."""
    directory = hf_dirs["deepseek_v3"]
    attention = read_hf_layer(directory, 1).attention
    spec = ModelSpec("v3", attention, checkpoint=str(directory), layer=1)
    engine = Engine(
        [spec], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**24
    )
    cache = engine.sessions.cache("v3")
    k, v = cache.read(*_one_session(engine))
    assert k.shape[1:] == (1, 5, 4 + 16) and v is k
    assert cache.bytes_per_token == (4 + 16) * 4  # float32


def _one_session(engine):
    """One 5-token session step on "v3": its (block_table, num_tokens)."""

    hosted = engine.get("v3")
    sid = engine.create_session("v3").session_id
    run(engine, hosted, req("v3", torch.randn(1, 5, 64), session_id=sid))
    session = engine.sessions.table.get(sid)
    return session.block_table, session.num_tokens


@pytest.mark.parametrize(
    ("config", "edits", "piece"),
    [
        # transformers repeats its expanded heads H // KVH times more: no layer (its default
        # 128 beside 4 heads, a repeat of 0, SDPA runs: V3 above)
        (
            DeepseekV3Config(**V3),
            {"num_key_value_heads": 2},
            "deepseek_v3 num_key_value_heads 2 is not supported",
        ),
        # DeepSeek's rotary embedding ignores it where the default RoPE runs, yarn's reads it
        (
            DeepseekV3Config(**V3),
            {"partial_rotary_factor": 0.5},
            "partial_rotary_factor 0.5 is not supported for deepseek_v3",
        ),
        (DeepseekV3Config(**V3), {"kv_lora_rank": 0}, "kv_lora_rank must be a positive int"),
        (DeepseekV3Config(**V3), {"v_head_dim": None}, "v_head_dim"),
        (DeepseekV3Config(**V3), {"model_type": "mistral4"}, "llama_4_scaling_beta"),
        (DeepseekV3Config(**V3), {"model_type": "deepseek_v32"}, "lightning indexer"),
        (DeepseekV3Config(**V3), {"model_type": "glm_moe_dsa"}, "lightning indexer"),
        (DeepseekV3Config(**V3), {"model_type": "longcat_flash"}, "two attention modules"),
        (DeepseekV3Config(**V3), {"model_type": "deepseek_v4"}, "shared K/V head"),
        # A.X-K1's attention always takes q through its latent (AXK1Config types it int)
        (AXK1Config(**V3), {"q_lora_rank": None}, "axk1 config.json sets q_lora_rank to null"),
        # Youtu's num_key_value_heads is typed int (V3's takes a null: the heads)
        (YoutuConfig(**YOUTU), {"num_key_value_heads": None}, "sets num_key_value_heads to null"),
        # Kimi Linear's KDA layers (linear attention), naming its MLA ones; without
        # layer_types nor linear_attn_config every 4th from layer 4 is MLA: none of 2
        (
            KimiLinearConfig(**KIMI),
            {},
            "layer 0 of kimi_linear is a 'linear_attention' layer (Kimi Delta Attention",
        ),
        (KimiLinearConfig(**KIMI), {"layer_types": None}, "full_attention layers are none"),
    ],
    ids=[
        *("kv_heads", "partial_rotary", "kv_lora_rank_0", "v_head_dim_null", "mistral4"),
        *("deepseek_v32", "glm_moe_dsa", "longcat_flash", "deepseek_v4"),
        *("axk1_q_lora_rank_null", "youtu_kv_heads_null", "kimi_linear_kda"),
        "kimi_linear_default_kinds",
    ],
)
def test_what_mla_families_cannot_serve_exactly_is_refused_by_name(tmp_path, config, edits, piece):
    directory = _config_only(tmp_path, config, **edits)
    with pytest.raises(ValueError) as err:
        read_hf_layer(directory, 0)
    assert piece in str(err.value), str(err.value)


def test_kimi_k25s_language_model_is_served_past_its_vision_tower(tmp_path):
    """Kimi K2.5 (kimi_k25): its text_config (model_type kimi_k2) is DeepSeek-V3's; its layer's
    tensors are the ones under language_model (the vision tower's are not read). The file is
    written with the model's own tensor names (model.language_model.layers...: transformers'
    save_pretrained renames them for Moonshot's original layout)."""
    from safetensors.torch import save_file
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = {**DeepseekV3Config(**V3).to_dict(), "model_type": "kimi_k2"}
    vision = {"num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32}
    vision.update({"intermediate_size": 32, "patch_size": 4})
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32)
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "kimi_k25"
    state = {k: t.clone() for k, t in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    info = read_hf_layer(tmp_path, 1)
    assert info.family == "kimi_k25" and info.attention.mla is not None
    assert info.tensor_scope == "language_model"
    module, _ = load_hf_layer(tmp_path, 1)
    base = model.model.language_model
    x = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, _ = reference_attention("deepseek_v3", base, 1, x)
        got = module(x).output
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# Prompts expanded (model/mla.py): each shape of the expanded heads, N + R against V: equal
# (deepseek_v3, glm4_moe_lite, kimi_linear: NoPE), V narrower (deepseek_v2: its values
# zero-padded), V wider (minicpm3: its queries and keys zero-padded)
PROMPT = 80  # >= mla.EXPAND_MIN_ROWS
CUTS = [0, PROMPT, PROMPT + 1, PROMPT + 2, PROMPT + 4]  # a prompt, two decode steps, a chunk


def _engine(directory, name: str, layer: int, dtype: torch.dtype = torch.float32) -> Engine:
    attention = read_hf_layer(directory, layer).attention
    spec = ModelSpec(name, attention, checkpoint=str(directory), layer=layer)
    return Engine([spec], device=torch.device("cpu"), dtype=dtype, max_response_bytes=2**24)


@pytest.fixture
def expansions(monkeypatch):
    """How many times the expanded form ran (mla.expand_keys, the real one, counted)."""
    calls = []
    real = mla.expand_keys

    def counted(module, k):
        calls.append(k.shape[2])
        return real(module, k)

    monkeypatch.setattr(mla, "expand_keys", counted)
    return calls


@pytest.mark.parametrize(
    "checkpoint", ["deepseek_v3", "deepseek_v2", "minicpm3", "glm4_moe_lite", "kimi_linear"]
)
def test_a_prompt_expanded_then_decode_absorbed_is_served_as_transformers(
    hf_dirs, checkpoint, expansions
):
    """A stateless prompt and a session's first step run expanded, its decode steps and a
    short chunk absorbed over the latents the prompt cached: each equal to transformers'
    attention over the whole sequence at once and to its own incremental path (a
    DynamicCache fed the same chunks)."""
    directory, layer = hf_dirs[checkpoint], CHECKPOINTS[checkpoint][2]
    engine = _engine(directory, checkpoint, layer)
    hosted = engine.get(checkpoint)
    base = load_reference(checkpoint, directory)
    x = torch.randn(
        1, CUTS[-1], base.config.hidden_size, generator=torch.Generator().manual_seed(6)
    )
    with torch.no_grad():
        whole, _ = reference_attention(checkpoint, base, layer, x)
        steps, _ = reference_decode(checkpoint, base, layer, x, CUTS)
    got = run(engine, hosted, req(checkpoint, x[:, :PROMPT], causal=True)).output
    torch.testing.assert_close(got, whole[:, :PROMPT], atol=1e-5, rtol=1e-5)
    assert expansions == [PROMPT]
    sid = engine.create_session(checkpoint).session_id
    for (a, b), want in zip(zip(CUTS, CUTS[1:], strict=False), steps, strict=True):
        got = run(engine, hosted, req(checkpoint, x[:, a:b], session_id=sid)).output
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, whole[:, a:b], atol=1e-5, rtol=1e-5)
    assert expansions == [PROMPT, PROMPT]  # the session's prompt; its later steps absorbed


def test_a_bfloat16_prompt_expanded_is_as_close_to_transformers_as_absorbed(hf_dirs):
    """bfloat16 (weights and cache): the expanded prompt's answer against transformers'
    float32 one, no further from it than the absorbed form's (within bfloat16's rounding of
    outputs near 1)."""
    directory, layer = hf_dirs["deepseek_v3"], CHECKPOINTS["deepseek_v3"][2]
    engine = _engine(directory, "v3", layer, torch.bfloat16)
    hosted = engine.get("v3")
    base = load_reference("deepseek_v3", directory)
    x = torch.randn(1, PROMPT, base.config.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, _ = reference_attention("deepseek_v3", base, layer, x)
    sid = engine.create_session("v3").session_id
    got = run(engine, hosted, req("v3", x, session_id=sid)).output.double()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mla, "EXPAND_MIN_ROWS", 1 << 30)
        other = engine.create_session("v3").session_id
        absorbed = run(engine, hosted, req("v3", x, session_id=other)).output.double()
    err, err_absorbed = (got - want).abs().max(), (absorbed - want).abs().max()
    print(
        f"bfloat16 max abs error of outputs up to {want.abs().max():.2f}: expanded "
        f"{err:.2e}, absorbed {err_absorbed:.2e}"
    )
    assert err < 2 * err_absorbed + 2e-3 and err < 0.05 * want.abs().max()

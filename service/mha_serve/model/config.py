"""Shape of one attention module: MHA, GQA and MQA are the same config with a
different num_kv_heads; the families' options (rotary position embeddings, q/k
normalisation, a sliding window, logit soft-capping, attention sinks, ALiBi, the softmax
scale, multi-head latent attention, an output gate) are data too.
Checked once at construction so nothing downstream re-checks. No torch here."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

Variant = Literal["mha", "gqa", "mqa"]

_BOOL_FIELDS = (
    *("bias", "causal", "sinks", "alibi", "alibi_bfloat16", "output_gate"),
    *("output_gate_per_head", "v_norm"),
)
# Boolean options written out (to_dict) only when true: a config without them reads as before.
_SET_ONLY = ("sinks", "alibi", "alibi_bfloat16", "output_gate", "output_gate_per_head", "v_norm")
# RoPE variants whose frequencies are fixed at load time, so that keys rotated once and
# cached stay right. "dynamic" and "longrope" change frequencies with the sequence length.
# "proportional" (Gemma 4's global layers): halves over the whole head, the first
# int(partial * head_dim // 2) frequencies theta ** (-2i / head_dim), the others 0 (those
# dims pass through), all divided by factor.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
# Over what a q/k RMSNorm normalises: each head's head_dim values (Qwen3, Gemma 3), or the
# whole projection, all heads' values together (OLMo-2: q over H*D, k over KVH*D).
QK_NORM_SCOPES = ("head", "projection")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embeddings as Hugging Face's Llama family applies them: the two
    halves of each head's q and k rotated (rotate_half) by position * inv_freq, where
    inv_freq = theta ** (-2i / head_dim), rescaled by `type` (transformers'
    modeling_rope_utils: _compute_{linear_scaling,llama3,yarn}_parameters)."""

    theta: float = 10000.0  # base wavelength (rope_theta)
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear, llama3, yarn, proportional: context extension factor
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn: the pretraining context
    beta_fast: float = 32.0  # yarn: ramp bounds (rotations)
    beta_slow: float = 1.0
    attention_factor: float = 0.0  # yarn: cos/sin scale; 0 -> derived from factor, mscale
    mscale: float = 0.0  # yarn (0: unset)
    mscale_all_dim: float = 0.0  # yarn (0: unset)
    truncate: bool = True  # yarn: round the correction range outwards
    # Pairs (x[0::2], x[1::2]) rotated, not the two halves of each head (Cohere, GLM,
    # Helium, ERNIE 4.5: their rotate_half interleaves).
    interleaved: bool = False
    # The fraction of each head's dims rotated, the first ones; the rest pass through (GLM's
    # partial_rotary_factor). Frequencies over those dims only, as transformers computes them.
    # With type "proportional": the fraction of each head's frequencies that are not 0, over
    # the whole head (rope_dim is head_dim).
    partial: float = 1.0
    # Turned the other way, by -position * inv_freq (nanochat: its rotate_half is [x2, -x1],
    # so sin's sign flips; cos and the norms are the same).
    reverse: bool = False

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(
                f"rope type {self.type!r} is not supported; supported: {', '.join(ROPE_TYPES)} "
                "(dynamic and longrope change frequencies with the sequence length, which keys "
                "rotated once and cached cannot follow)"
            )
        for name in (
            "theta",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "partial",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise ValueError(f"rope {name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("interleaved", "reverse"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"rope {name} must be true or false, got {getattr(self, name)!r}")
        if not 0 < self.partial <= 1:
            raise ValueError(f"rope partial must be in (0, 1], got {self.partial}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta and factor must be > 0, got {self.theta}, {self.factor}")
        if self.type in ("llama3", "yarn") and self.original_max_position_embeddings < 1:
            raise ValueError(f"rope type {self.type} needs original_max_position_embeddings >= 1")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope llama3 needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RopeConfig:
        return _from_table(cls, d, "rope")


@dataclass(frozen=True)
class QKNormConfig:
    """RMSNorm of the projected queries and keys: x / sqrt(mean(x^2) + eps) * weight, in
    float32, over `scope`; before RoPE (where Qwen3, OLMo-2 and Gemma 3 apply it) or after
    it (Llama 4's L2Norm, nanochat's, Hunyuan v1's). The weights (q_norm, k_norm) come from
    the checkpoint; Gemma's 1 + w is folded at load; without a gain there are none (Llama 4,
    nanochat: x * rsqrt(mean(x^2) + eps) alone)."""

    scope: str = "head"  # one of QK_NORM_SCOPES
    eps: float = 1e-6
    after_rope: bool = False  # True: q and k rotated first, then normed
    gain: bool = True  # False: no q_norm, k_norm weights (a gain of 1)

    def __post_init__(self) -> None:
        if self.scope not in QK_NORM_SCOPES:
            raise ValueError(
                f"qk_norm scope {self.scope!r} is not supported; supported: "
                f"{', '.join(QK_NORM_SCOPES)} (head: over each head's head_dim values; "
                "projection: over all heads of q, and of k, together)"
            )
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < math.inf:
            raise ValueError(f"qk_norm eps must be a finite number >= 0, got {eps!r}")
        object.__setattr__(self, "eps", float(eps))
        for name in ("after_rope", "gain"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"qk_norm {name} must be true or false, got {getattr(self, name)!r}"
                )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QKNormConfig:
        return _from_table(cls, d, "qk_norm")


@dataclass(frozen=True)
class QueryScaleConfig:
    """Queries scaled by their absolute position p (Llama 4's attention temperature tuning
    on its NoPE layers, Ministral 3's and Mistral 4's llama_4_scaling_beta): q times
    1 + beta * log(1 + floor((p + offset) / floor_div)), after RoPE and the q/k norm; the
    keys are not scaled. In float32 from float32 positions, as transformers computes it;
    then either the scale rounded to q's dtype and multiplied in it (Ministral 3's
    get_llama_4_attn_scale(..).to(q.dtype)), or q times the float32 scale in float32,
    rounded after (float32 true: Llama 4's (q * scales).to(q.dtype), whose log is log1p)."""

    beta: float  # Llama 4's attn_scale; Ministral 3's llama_4_scaling_beta
    floor_div: float  # Llama 4's floor_scale; Ministral 3's original_max_position_embeddings
    offset: int = 0  # added to the position first (Llama 4: 1)
    float32: bool = False  # True: the product in float32 (Llama 4); False: in q's dtype

    def __post_init__(self) -> None:
        for name in ("beta", "floor_div"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise ValueError(f"query_scale {name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not self.floor_div > 0:
            raise ValueError(f"query_scale floor_div must be > 0, got {self.floor_div}")
        if self.beta < 0:  # (a negative one could scale a query by zero or flip its sign)
            raise ValueError(f"query_scale beta must be >= 0, got {self.beta}")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"query_scale offset must be an int >= 0, got {self.offset!r}")
        if not isinstance(self.float32, bool):
            raise ValueError(f"query_scale float32 must be true or false, got {self.float32!r}")

    def factor(self, position: int) -> float:
        """A bound on the scale at positions 0..position (it only grows with p), in float64:
        1% over the exact value, for its float32 computation and its rounding to a half
        precision (at most 2^-8 of it) before or after the product."""
        steps = math.floor((position + self.offset) / self.floor_div)
        return (1.0 + self.beta * math.log1p(steps)) * 1.01

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QueryScaleConfig:
        missing = [name for name in ("beta", "floor_div") if name not in d]
        if missing:
            raise ValueError(f"query_scale is missing required key(s) {missing}")
        return _from_table(cls, d, "query_scale")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek V2/V3, Kimi K2, GLM-4.7-Flash, MiniCPM3; Kimi
    Linear's without RoPE: its R dims are shared by every head unrotated), served
    absorbed into MQA: one kv head of head_dim R + C per token, [rope(k_rope) (R); latent c
    (C)], its values the same tensor; each query head's q_nope folded through its W_uk, and
    its output's C dims through its W_uv (docs/models.md "Multi-head latent attention")."""

    kv_lora_rank: int  # C: the latent each token caches (kv_a's first C rows, normalised)
    rope_dim: int  # R: qk_rope_head_dim, the rotary dims of q and k (one k_rope for all heads;
    # without rope, NoPE, the same dims unrotated)
    nope_dim: int  # N: qk_nope_head_dim, each head's non-rotary q and k dims
    v_head_dim: int  # V: each head's value dims
    q_lora_rank: int | None = None  # Q: q through a rank-Q bottleneck; None: one projection
    eps: float = 1e-6  # RMSNorm eps of q_a_norm and kv_a_norm (rms_norm_eps)

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "rope_dim", "nope_dim", "v_head_dim"):
            _check_positive_int(f"mla {name}", getattr(self, name))
        if self.q_lora_rank is not None:
            _check_positive_int("mla q_lora_rank", self.q_lora_rank)
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < math.inf:
            raise ValueError(f"mla eps must be a finite number >= 0, got {eps!r}")
        object.__setattr__(self, "eps", float(eps))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MLAConfig:
        required = ("kv_lora_rank", "rope_dim", "nope_dim", "v_head_dim")
        missing = [name for name in required if name not in d]
        if missing:
            raise ValueError(f"mla is missing required key(s) {missing}")
        return _from_table(cls, d, "mla")


@dataclass(frozen=True)
class AttentionConfig:
    embed_dim: int  # E: width of input and output embeddings
    num_heads: int  # H: query heads
    num_kv_heads: int | None = None  # KVH: None -> num_heads (MHA); 1 -> MQA; a divisor of H -> GQA
    head_dim: int | None = None  # D: None -> embed_dim // num_heads
    bias: bool = True  # bias on the QKV and output projections (mla: on q_a or q, kv_a and wo)
    causal: bool = False  # default masking for requests that do not say
    # Rotary position embeddings applied to q and k after projection, at absolute
    # positions (None: no positions at all, as nn.MultiheadAttention). A dict is read
    # as RopeConfig's fields (TOML, checkpoint metadata).
    rope: RopeConfig | None = None
    # Multiplies q.k before the softmax; None -> 1 / sqrt(head_dim). (GPT-2 can scale by
    # 1 / (layer + 1) too, or not at all.)
    softmax_scale: float | None = None
    # Each query attends to the last `sliding_window` keys, itself included: key j is seen
    # from query i when i - window < j (and j <= i when causal; |i - j| < window when not).
    # None: every key. Mistral, Qwen2/3's sliding layers, Phi-3, Gemma 2/3's local layers.
    sliding_window: int | None = None
    # RMSNorm of q and k before RoPE (QKNormConfig; a dict is read as its fields); None: none.
    qk_norm: QKNormConfig | None = None
    # Attention-logit soft-capping (Gemma 2): scores become softcap * tanh(scores / softcap)
    # before the mask and softmax. None: none.
    softcap: float | None = None
    # Attention sinks (GPT-OSS): a learned logit per query head (the `sinks` weight, (H,))
    # joins each row's softmax as one more column that attends to nothing, so the weights
    # over the keys sum to less than 1. False: none.
    sinks: bool = False
    # ALiBi (Press et al.; BLOOM, MPT): each query head h adds slope_h * (key position -
    # query position) to its scores before the softmax (as slope_h * key position: the same
    # softmax), slopes from the head count (model/alibi.py). False: none.
    alibi: bool = False
    # The slopes' spread: head h of n = 2^ceil(log2 H) has slope 2^(-alibi_bias_max * h / n)
    # (8: the paper's and BLOOM's; MPT's alibi_bias_max). Read only with alibi.
    alibi_bias_max: float = 8.0
    # The factor on the bias (Falcon-RW: 1 / sqrt(head_dim), the scores' own: it adds the
    # bias to q . k before scaling both, so its slopes are slope / sqrt(head_dim)). None: 1.
    # Only with alibi.
    alibi_scale: float | None = None
    # slope * position in bfloat16, each term rounded as Falcon-RW's build_alibi_tensor
    # rounds it (bfloat16(slope) * position, positions absolute: a session's); up to 0.4% of
    # the bias apart from the exact one, which transformers' Falcon-RW does not compute.
    # False: exact. Only with alibi.
    alibi_bfloat16: bool = False
    # Multi-head latent attention (MLAConfig; a dict is read as its fields): q from a low-rank
    # q_a/q_b pair, k and v from one shared latent per token, served as MQA over head_dim
    # R + C (num_kv_heads 1, head_dim R + C, RoPE over all R dims required). None: none.
    mla: MLAConfig | None = None
    # An output gate (Qwen3-Next, Qwen3.5, AFMoE): each query head's output, per token and dim,
    # multiplied by sigmoid(wgate x) before wo (the `wgate` Linear, H*D <- E, biased as the
    # projections are; Qwen's q_proj rows per head [query; gate], split at load; with mla
    # H*V: each head's output after its W_uv). False: none.
    output_gate: bool = False
    # RMSNorm of each value head over its head_dim values, without a gain (Gemma 3n's and
    # Gemma 4's v_norm): v / sqrt(mean(v^2) + eps), eps the q/k norm's, before the values are
    # cached. Needs qk_norm per head (its eps). False: values as projected.
    v_norm: bool = False
    # With output_gate: one gate value per head (wgate H <- E; LFM3, Ling 3.0's MLA layers),
    # multiplying every dim of that head's output. (The same as a per-dim gate whose rows
    # repeat each head's head_dim times, at 1/head_dim of its projection's cost.)
    output_gate_per_head: bool = False
    # Queries scaled by position (QueryScaleConfig; a dict is read as its fields): Llama 4's
    # NoPE layers, Ministral 3, Mistral 4. None: none.
    query_scale: QueryScaleConfig | None = None
    # Chunked attention (Llama 4's RoPE layers): a query at p sees keys from
    # floor(p / chunk_size) * chunk_size to p. Served up to chunk_size positions only, where
    # it is causal attention: a model's max_seq_len may not pass it (spec.py). None: none.
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        # Values often come from TOML or safetensors metadata, so check types
        # too: bool is an int subclass and "8" is not 8.
        for name in ("embed_dim", "num_heads"):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(
                    f"{name} must be a bool (true/false), got {value!r} of type "
                    f"{type(value).__name__}"
                )

        if isinstance(self.rope, dict):
            object.__setattr__(self, "rope", RopeConfig.from_dict(self.rope))
        if self.rope is not None and not isinstance(self.rope, RopeConfig):
            raise ValueError(f"rope must be a table of RopeConfig fields, got {self.rope!r}")
        if isinstance(self.qk_norm, dict):
            object.__setattr__(self, "qk_norm", QKNormConfig.from_dict(self.qk_norm))
        if self.qk_norm is not None and not isinstance(self.qk_norm, QKNormConfig):
            raise ValueError(
                f"qk_norm must be a table of QKNormConfig fields, got {self.qk_norm!r}"
            )
        if isinstance(self.query_scale, dict):
            object.__setattr__(self, "query_scale", QueryScaleConfig.from_dict(self.query_scale))
        if self.query_scale is not None and not isinstance(self.query_scale, QueryScaleConfig):
            raise ValueError(
                f"query_scale must be a table of QueryScaleConfig fields, got {self.query_scale!r}"
            )
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)
        if self.v_norm and (self.qk_norm is None or self.qk_norm.scope != "head"):
            raise ValueError(
                "v_norm needs qk_norm with scope 'head': the value norm takes the q/k norm's "
                "eps (as Gemma 3n and Gemma 4 norm q, k and v with one rms_norm_eps); set "
                'qk_norm = { scope = "head", eps = ... }, or leave v_norm out'
            )
        if self.chunk_size is not None:
            _check_positive_int("chunk_size", self.chunk_size)
            if not self.causal:
                raise ValueError(
                    "chunk_size needs causal = true: chunked attention is causal within a chunk"
                )
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MLAConfig.from_dict(self.mla))
        if self.mla is not None:
            self._resolve_mla()
        if self.output_gate_per_head and not self.output_gate:
            raise ValueError(
                "output_gate_per_head is set but output_gate is not: it shapes the output "
                "gate; set output_gate = true, or leave output_gate_per_head out"
            )
        for name in ("softcap", "alibi_bias_max", "alibi_scale"):  # (the first and last: None
            value = getattr(self, name)  # is off; alibi_bias_max has no None)
            if value is not None or name == "alibi_bias_max":
                object.__setattr__(self, name, _positive_number(name, value))
        for name in ("alibi_scale", "alibi_bfloat16"):
            if not self.alibi and getattr(self, name) not in (None, False):
                raise ValueError(
                    f"{name} is set but alibi is not: it shapes ALiBi's bias; set alibi = "
                    f"true, or leave {name} out"
                )
        if self.alibi and (self.softcap is not None or self.sinks):
            raise ValueError(
                "alibi with softcap or sinks is not supported: no family has both, and where "
                "the bias goes (before or after the cap; beside the sink) changes the answer"
            )
        if self.softmax_scale is not None:
            scale = self.softmax_scale
            if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
                raise ValueError(f"softmax_scale must be a number > 0, got {scale!r}")
            object.__setattr__(self, "softmax_scale", float(scale))

        if self.head_dim is None:
            if self.embed_dim % self.num_heads != 0:
                raise ValueError(
                    f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}; "
                    "set head_dim explicitly or change embed_dim"
                )
            object.__setattr__(self, "head_dim", self.embed_dim // self.num_heads)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)

        if self.rope is not None and self.mla is None and self.head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.head_dim}")
        if self.rope is not None and self.rope.partial != 1:
            turned = self.rope_dim
            if turned < 2 or turned % 2:
                raise ValueError(
                    f"rope partial {self.rope.partial} of head_dim {self.head_dim} rotates "
                    f"{turned} dims: it must be an even number >= 2"
                )

        kvh, h = self.num_kv_heads, self.num_heads
        if kvh > h or h % kvh != 0:
            raise ValueError(
                f"num_kv_heads {kvh} must divide num_heads {h} "
                f"(1 = MQA, {h} = MHA, or a divisor for GQA)"
            )

    def _resolve_mla(self) -> None:
        """MLA's fixed shape (one kv head of R + C dims) filled in, and what it cannot go
        with refused."""
        m = self.mla
        if not isinstance(m, MLAConfig):
            raise ValueError(f"mla must be a table of MLAConfig fields, got {m!r}")
        width = m.rope_dim + m.kv_lora_rank
        for name, value in (("num_kv_heads", 1), ("head_dim", width)):
            given = getattr(self, name)
            if given is not None and given != value:
                raise ValueError(
                    f"{name} {given} does not fit mla: its kv head count is 1 and its head_dim "
                    f"rope_dim + kv_lora_rank = {width}; leave {name} out"
                )
            object.__setattr__(self, name, value)
        if self.rope is not None and m.rope_dim % 2:  # (without rope: NoPE, not rotated)
            raise ValueError(f"mla rope_dim must be even (RoPE turns pairs), got {m.rope_dim}")
        if self.rope is not None and self.rope.partial != 1:
            raise ValueError(
                f"mla rotates all of its rope_dim {m.rope_dim} dims: rope partial must be 1 "
                f"(left out), got {self.rope.partial}"
            )
        given = [
            name
            for name, on in (
                ("qk_norm", self.qk_norm is not None),
                ("sinks", self.sinks),
                ("alibi", self.alibi),
                ("softcap", self.softcap is not None),
                ("v_norm", self.v_norm),
            )
            if on
        ]
        if given:
            raise ValueError(
                f"mla with {', '.join(given)} is not supported: no MLA family has them; "
                "leave them out"
            )

    @property
    def variant(self) -> Variant:
        # num_heads == 1 is both "MHA" and "MQA"; call it MHA (no sharing happens).
        if self.num_kv_heads == self.num_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    @property
    def rope_dim(self) -> int:
        """The dims of each head that RoPE rotates (the first ones): int(head_dim * partial),
        as transformers counts them; 0 without RoPE. With mla: its rope_dim. Proportional
        RoPE turns the whole head (the dims past its proportion at frequency 0)."""
        if self.mla is not None:
            return self.mla.rope_dim
        if self.rope is not None and self.rope.type == "proportional":
            return self.head_dim  # (its frequencies past the proportion are 0)
        return 0 if self.rope is None else int(self.head_dim * self.rope.partial)

    @property
    def gate_width(self) -> int:
        """The output gate's width, wgate's rows (0 without one): one per head with
        output_gate_per_head, else one per dim of each head's output (H * head_dim; with mla
        H * v_head_dim, the merged heads' width)."""
        if not self.output_gate:
            return 0
        if self.output_gate_per_head:
            return self.num_heads
        return self.num_heads * (self.head_dim if self.mla is None else self.mla.v_head_dim)

    @property
    def group_size(self) -> int:
        """Query heads that share one kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def values_are_keys(self) -> bool:
        """Whether project's values are its keys, the same tensor (mla: k' = [rope; c] is
        both): the KV cache then stores K alone (KVCache's values_are_keys)."""
        return self.mla is not None

    @property
    def qkv_dim(self) -> int:
        """Output width of the fused QKV projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def scale(self) -> float:
        """The factor on q.k before the softmax: softmax_scale, or 1 / sqrt(head_dim); with
        mla 1 / sqrt(nope_dim + rope_dim), the width of HF's q . k (the absorbed head_dim
        R + C is the kernel's, not the model's)."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        if self.mla is not None:
            return (self.mla.nope_dim + self.mla.rope_dim) ** -0.5
        return self.head_dim**-0.5

    @property
    def score_factor(self) -> float:
        """How far past |q . k| a kernel's intermediate scores may reach: the scale when it
        is above 1 (scores may be scaled after the product), times 1 / softcap when that is
        (scores / softcap). The overflow check holds |q . k| under the dtype's max over this."""
        factor = max(1.0, self.scale)
        if self.softcap is not None:
            factor *= max(1.0, 1.0 / self.softcap)
        return factor

    def to_dict(self) -> dict[str, Any]:
        """Every field, resolved (no None: the options only when set, sinks, alibi,
        alibi_bfloat16, output_gate, output_gate_per_head and v_norm only when True,
        alibi_bias_max only with alibi; rope, qk_norm, mla and query_scale as dicts of their
        fields), so the dict is the config on its own."""
        d = asdict(self)
        if not self.alibi:
            del d["alibi_bias_max"]
        norm = d["qk_norm"]
        if norm is not None:  # (its place and gain only when not the default: before, with)
            for name, default in (("after_rope", False), ("gain", True)):
                if norm[name] == default:
                    del norm[name]
        if d["rope"] is not None and not d["rope"]["reverse"]:  # (likewise)
            del d["rope"]["reverse"]
        return {k: v for k, v in d.items() if v is not None and (k not in _SET_ONLY or v)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionConfig:
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ValueError(f"unknown attention config key(s) {unknown}; valid keys are {valid}")
        missing = [name for name in ("embed_dim", "num_heads") if name not in d]
        if missing:
            raise ValueError(f"attention config is missing required key(s) {missing}")
        return cls(**d)


def _from_table(cls: type, d: dict[str, Any], name: str) -> Any:
    """cls(**d) for a table of cls's fields, naming any unknown key."""
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(d) - set(valid))
    if unknown:
        raise ValueError(f"unknown {name} key(s) {unknown}; valid keys are {valid}")
    return cls(**d)


def _positive_number(name: str, value: Any) -> float:
    """value as a float, when it is a finite number > 0 (ValueError naming `name` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")

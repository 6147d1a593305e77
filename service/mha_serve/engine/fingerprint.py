"""What a session's K/V are bound to: the model's shape and weights, hashed (a spilled or
moved session is adopted only by a model with the same fingerprint; its keys and values mean
nothing to any other)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from mha_serve.engine.types import HostedModel


def model_fingerprint(hosted: HostedModel) -> str:
    """sha256 of the attention config, the compute dtype, and every parameter (name, dtype,
    shape, bytes), in a fixed order."""
    digest = hashlib.sha256()
    config = dataclasses.asdict(hosted.spec.attention)
    # A field added since (sinks) is hashed only when set: a model without it keeps the
    # fingerprint earlier releases gave it, so its durable sessions survive an upgrade.
    if not config["sinks"]:
        del config["sinks"]
    if not config["alibi"]:  # (likewise ALiBi, and its bias_max, read only with it)
        del config["alibi"], config["alibi_bias_max"]
    for name, default in (("alibi_scale", None), ("alibi_bfloat16", False)):  # (likewise)
        if config[name] == default:
            del config[name]
    if config["mla"] is None:  # (likewise MLA)
        del config["mla"]
    if not config["output_gate"]:  # (likewise the output gate)
        del config["output_gate"]
    if not config["v_norm"]:  # (likewise the value norm)
        del config["v_norm"]
    if not config["output_gate_per_head"]:  # (likewise its one value per head)
        del config["output_gate_per_head"]
    for name in ("query_scale", "chunk_size"):  # (likewise)
        if config[name] is None:
            del config[name]
    norm = config["qk_norm"]
    if norm is not None:  # (likewise the q/k norm's place and gain)
        for name, default in (("after_rope", False), ("gain", True)):
            if norm[name] == default:
                del norm[name]
    rope = config["rope"]
    if rope is not None:  # (likewise RoPE's interleaved pairs and partial rotation)
        for name, default in (("interleaved", False), ("partial", 1.0), ("reverse", False)):
            if rope[name] == default:
                del rope[name]
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(str(hosted.dtype).encode())
    for name, tensor in sorted(hosted.module.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bf16
        digest.update(raw.numpy().reshape(-1).view("u1"))
    return digest.hexdigest()

"""Session records of a cache that stores K alone (its values are its keys: MLA): K once,
in a format of its own (FORMAT_KEYS), read back as (k, k); a V that is not the K refused
when writing; records of the older layout (K and V) loading when their V is their K and
refused, saying so, when not; a record of K alone refused by a cache of K and V, and
malformed ones."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch
from safetensors.torch import save as save_tensors

from mha_serve.cache.record import (
    FORMAT,
    FORMAT_KEYS,
    BadRecord,
    Expected,
    SessionRecord,
    decode,
    encode,
    read_header,
)

KVH, D = 2, 4


def keys(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, KVH, T, D, generator=torch.Generator().manual_seed(seed))


def record(**kw) -> SessionRecord:
    fields = dict(
        session_id="s1",
        model="m",
        fingerprint="f" * 64,
        num_tokens=12,
        first_position=0,
        max_len=64,
        ttl_s=600.0,
        idle_s=1.5,
        written_at=1000.0,
        owner="",
        dtype="float32",
        num_kv_heads=KVH,
        head_dim=D,
        values_are_keys=True,
    )
    return SessionRecord(**{**fields, **kw})


EXPECTED = Expected(
    "m", "f" * 64, torch.float32, KVH, D, max_len=64, max_bytes=1 << 20, values_are_keys=True
)


def header_of(data: bytes) -> dict:
    (size,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + size])


def test_a_record_of_k_alone_holds_k_once_in_its_own_format_and_reads_back_as_k_k():
    k = keys(1, 12, seed=8)[0]  # (KVH, 12, D)
    data = encode(record(), k, k)
    header = header_of(data)
    assert header["__metadata__"]["format"] == FORMAT_KEYS
    assert set(header) - {"__metadata__"} == {"k"}
    assert "values_are_keys" not in json.loads(header["__metadata__"]["session"])
    both = encode(record(values_are_keys=False), k, k.clone())  # the older layout
    assert header_of(both)["__metadata__"]["format"] == FORMAT
    assert abs(len(both) - len(data) - k.nbytes) < 200  # K once, not twice (headers aside)
    got, gk, gv = decode(data, "f", EXPECTED)
    assert gv is gk and torch.equal(gk, k)
    assert got.values_are_keys and read_header(data, "f").values_are_keys
    assert dataclasses.replace(got, checksum="") == record()


def test_encoding_a_v_that_is_not_k_in_a_record_of_k_alone_is_refused():
    k = keys(1, 12, seed=9)[0]
    with pytest.raises(ValueError, match="v must be the k tensor itself"):
        encode(record(), k, k.clone())


def test_a_record_of_the_older_layout_loads_when_its_v_is_its_k():
    """Written before the cache stored K once (format /1, k and v, equal): adopted as K
    alone; one whose V differs is refused, saying so."""
    k = keys(1, 12, seed=10)[0]
    old = encode(record(values_are_keys=False), k, k.clone())
    got, gk, gv = decode(old, "old.session", EXPECTED)
    assert gv is gk and torch.equal(gk, k) and got.values_are_keys
    bad = encode(record(values_are_keys=False), k, keys(1, 12, seed=11)[0])
    with pytest.raises(BadRecord, match="its values differ from its keys, but model 'm'"):
        decode(bad, "bad.session", EXPECTED)
    # its size is checked as this cache holds it: K alone
    tight = dataclasses.replace(EXPECTED, max_bytes=k.nbytes)
    assert torch.equal(decode(old, "old.session", tight)[1], k)


def test_a_record_of_k_alone_is_refused_by_a_cache_of_k_and_v_and_when_malformed():
    k = keys(1, 12, seed=12)[0]
    data = encode(record(), k, k)
    apart = dataclasses.replace(EXPECTED, values_are_keys=False)
    with pytest.raises(BadRecord, match="holds K alone .* stores K and V apart"):
        decode(data, "f", apart)
    # a file of the keys' format with a v, or a header that names the layout itself
    metadata = header_of(data)["__metadata__"]
    with_v = save_tensors({"k": k, "v": k.clone()}, metadata=metadata)
    with pytest.raises(BadRecord, match=r"holds tensors \['k', 'v'\], not k alone"):
        decode(with_v, "f", EXPECTED)
    session = {**json.loads(metadata["session"]), "values_are_keys": True}
    named = save_tensors({"k": k}, metadata={**metadata, "session": json.dumps(session)})
    with pytest.raises(BadRecord, match="a header field values_are_keys"):
        decode(named, "f", EXPECTED)
    other = save_tensors({"k": k}, metadata={**metadata, "format": "mha-serve-session/9"})
    with pytest.raises(BadRecord, match="format 'mha-serve-session/9', not"):
        decode(other, "f", EXPECTED)

"""The session record and the spill store alone: a record reads back bit for bit; truncated,
bit-flipped, foreign, NaN-holding and oversize files are refused with what is wrong; writes
are atomic; the budget expires the oldest; one live store per directory."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mha_serve.cache import SpillDirInUse, SpillFull, SpillStore
from mha_serve.cache.record import (
    BadRecord,
    Expected,
    SessionRecord,
    decode,
    encode,
    read_header,
)
from mha_serve.cache.spill import TEMP_PREFIX

KVH, D = 2, 8


def record(session_id: str = "s1", num_tokens: int = 20, first: int = 0, **kw) -> SessionRecord:
    fields = dict(
        session_id=session_id,
        model="m",
        fingerprint="f" * 64,
        num_tokens=num_tokens,
        first_position=first,
        max_len=64,
        ttl_s=600.0,
        idle_s=1.5,
        written_at=1000.0,
        owner="token:abc",
        dtype="float32",
        num_kv_heads=KVH,
        head_dim=D,
    )
    return SessionRecord(**{**fields, **kw})


def kv(n: int, seed: int = 0, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(KVH, n, D, generator=g).to(dtype), torch.randn(KVH, n, D, generator=g).to(
        dtype
    )


EXPECTED = Expected("m", "f" * 64, torch.float32, KVH, D, max_len=64, max_bytes=1 << 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_record_reads_back_bit_for_bit(dtype):
    name = str(dtype).removeprefix("torch.")
    r = record(num_tokens=20, first=4, dtype=name)
    k, v = kv(16, dtype=dtype)
    data = encode(r, k, v)
    got, k2, v2 = decode(data, "f", dataclasses.replace(EXPECTED, dtype=dtype))
    assert dataclasses.replace(got, checksum="") == r and got.held == 16
    assert torch.equal(
        k2.view(torch.int16 if dtype != torch.float32 else torch.int32),
        k.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )
    assert torch.equal(v2, v)


def _flip(data: bytes, offset: int) -> bytes:
    b = bytearray(data)
    b[offset] ^= 0x01
    return bytes(b)


def bad_files() -> list[tuple[str, bytes, str]]:
    k, v = kv(20)
    good = encode(record(), k, v)
    nan_k = k.clone()
    nan_k[1, 3, 2] = float("nan")
    return [
        ("truncated", good[: len(good) - 100], "cannot be read|truncated"),
        ("cut in its header", good[:20], "truncated or not a session file|too short"),
        ("bit flipped", _flip(good, len(good) - 7), "checksum"),
        ("another model", encode(record(model="other"), k, v), "model 'other', not 'm'"),
        ("another fingerprint", encode(record(fingerprint="0" * 64), k, v), "other weights"),
        ("NaN in its keys", encode(record(), nan_k, v), "NaN or Inf"),
        (
            "too long for the model",
            encode(record(num_tokens=80, max_len=None), *kv(80)),
            "max_seq_len",
        ),
        (
            "other heads",
            encode(record(num_kv_heads=4), *[t.reshape(4, 10, D) for t in kv(20)]),
            "4 heads x 8",
        ),
        (
            "lengths that do not add up",
            encode(record(num_tokens=30), k, v),
            r"needs float32 \[2, 30, 8\]",
        ),
        (
            "not a session file",
            b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"{}" + b" " * 14,
            "not a session file",
        ),
        ("a sequence id of nothing", encode(record(sequence_id=""), k, v), "not a sequence's"),
        ("a sequence id of truth", encode(record(sequence_id=True), k, v), "not a sequence's"),
    ]


@pytest.mark.parametrize(("what", "data", "message"), bad_files(), ids=[b[0] for b in bad_files()])
def test_a_bad_or_foreign_file_is_refused_saying_what_is_wrong(what, data, message):
    with pytest.raises(BadRecord, match=message):
        decode(data, "f.session", EXPECTED)


def test_a_file_larger_than_the_models_cache_is_refused():
    k, v = kv(20)
    with pytest.raises(BadRecord, match="the whole KV cache of model .m. holds"):
        decode(encode(record(), k, v), "f", dataclasses.replace(EXPECTED, max_bytes=100))


def test_the_store_expires_its_oldest_to_keep_the_budget(tmp_path):
    k, v = kv(20)
    size = len(encode(record(), k, v))
    store = SpillStore(tmp_path, budget_bytes=int(2.5 * size))
    assert store.put(record("a"), k, v) == [] and store.put(record("b"), k, v) == []
    expired = store.put(record("c"), k, v)
    assert [e.session_id for e in expired] == ["a"] and list(store.entries) == ["b", "c"]
    assert not store.path_for("a").exists() and store.path_for("c").exists()
    assert store.nbytes == 2 * size
    with pytest.raises(SpillFull, match="more than the whole spill budget"):
        store.put(record("d", num_tokens=60), *kv(60))
    store.close()


def test_a_session_whose_restore_failed_is_not_the_next_to_expire(tmp_path):
    """A restore that finds no room in the cache (its call then waits for some) puts the
    session back in the store: the sessions spilled before it still expire first (it was
    put back as the oldest, and lost to the next spill of a full store)."""
    k, v = kv(20)
    size = len(encode(record(), k, v))
    store = SpillStore(tmp_path, budget_bytes=int(2.5 * size))
    store.put(record("a"), k, v)
    store.put(record("b"), k, v)
    store.attach(store.detach("b"))  # b's restore found no room
    expired = store.put(record("c"), k, v)
    assert [e.session_id for e in expired] == ["a"] and list(store.entries) == ["b", "c"]
    store.close()


def test_a_rewrite_replaces_the_file_whole_and_a_failed_write_leaves_the_old_copy(
    tmp_path, monkeypatch
):
    store = SpillStore(tmp_path, budget_bytes=1 << 20)
    k, v = kv(20, seed=1)
    store.put(record("a"), k, v)
    before = store.path_for("a").read_bytes()

    def broken_replace(src, dst):  # the crash between writing the temporary and the rename
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        store.put(record("a", num_tokens=21), *kv(21, seed=2))
    monkeypatch.undo()
    assert store.path_for("a").read_bytes() == before  # the old copy, never a torn one
    assert store.get("a").record.num_tokens == 20
    assert not list(tmp_path.glob(TEMP_PREFIX + "*"))  # its temporary gone
    store.close()


def test_a_start_removes_temporaries_and_adopts_by_header_refusing_foreign_files(tmp_path):
    store = SpillStore(tmp_path, budget_bytes=1 << 20)
    k, v = kv(20)
    store.put(record("a", written_at=5.0), k, v)
    store.put(record("b", written_at=2.0), k, v)
    store.put(record("z", model="other"), k, v)
    store.close()
    (tmp_path / (TEMP_PREFIX + "deadbeef")).write_bytes(b"half a file")
    (tmp_path / "junk.session").write_bytes(b"not one")
    again = SpillStore(tmp_path, budget_bytes=1 << 20)
    found, refused = again.scan(lambda r: EXPECTED if r.model == "m" else None)
    assert [s.session_id for s in found] == ["b", "a"]  # oldest written first
    assert sorted(p.name for p, _, _ in refused) == sorted(
        ["junk.session", again.path_for("z").name]
    )
    # z's header could be read (its record), junk's not
    assert sorted(str(r and r.session_id) for _, _, r in refused) == ["None", "z"]
    assert not list(tmp_path.glob(TEMP_PREFIX + "*"))
    assert len(list(tmp_path.glob("*.refused"))) == 2  # kept for inspection
    assert read_header(again.path_for("a").read_bytes(), "a").owner == "token:abc"
    again.close()


def test_one_live_server_per_directory(tmp_path):
    """Another process holding the directory's lock is refused, named; once it is gone
    (its lock went with it), the directory is free again."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys
                from mha_serve.cache import SpillStore
                store = SpillStore({str(tmp_path)!r}, budget_bytes=1 << 20)
                print("held", flush=True)
                sys.stdin.readline()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            SpillDirInUse, match=rf"in use by another live mha-serve \(pid {holder.pid}"
        ):
            SpillStore(tmp_path, budget_bytes=1 << 20)
    finally:
        holder.stdin.close()
        holder.wait(30)
    SpillStore(tmp_path, budget_bytes=1 << 20).close()  # free again


@pytest.mark.parametrize("sequence_id", [42, "chat-7", None])
def test_the_sequence_a_session_steps_travels_with_it(sequence_id):
    """A Triton sequence's id (int or string) reads back as written; a file written before
    records had one reads as stepping none."""
    k, v = kv(20)
    got, _, _ = decode(encode(record(sequence_id=sequence_id), k, v), "f", EXPECTED)
    assert got.sequence_id == sequence_id
    fields = dataclasses.asdict(record())
    del fields["sequence_id"]  # (a file of the format before it)
    assert SessionRecord(**fields).sequence_id is None

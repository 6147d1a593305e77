"""Settings: defaults, TOML file, MHA_SERVE_* environment and flags, in that order of precedence."""

from __future__ import annotations

import pytest

from mha_serve.config import ServerConfig, build_config, default_models
from mha_serve.transport.main import main, parser
from tests.helpers import config_of


def test_built_in_models_are_three_variants_of_one_size():
    models = {m.name: m.attention for m in default_models()}
    assert {n: (a.embed_dim, a.num_heads, a.num_kv_heads) for n, a in models.items()} == {
        "mha": (512, 8, 8),
        "gqa": (512, 8, 2),
        "mqa": (512, 8, 1),
    }
    assert [a.variant for a in models.values()] == ["mha", "gqa", "mqa"]


def test_file_then_environment_then_flags(tmp_path, monkeypatch):
    cfg_file = tmp_path / "serve.toml"
    cfg_file.write_text(
        '[server]\nport = 6000\nmetrics_port = 6001\ndevice = "cpu"\n\n'
        '[[models]]\nname = "small"\nembed_dim = 64\nnum_heads = 4\nnum_kv_heads = 2\n'
        'causal = true\nmax_seq_len = 128\ncheckpoint = "w.safetensors"\n'
    )
    monkeypatch.setenv("MHA_SERVE_PORT", "7000")
    monkeypatch.setenv("MHA_SERVE_METRICS_PORT", "7001")
    cfg = config_of(["--config", str(cfg_file), "--metrics-port", "8001"])
    assert (cfg.port, cfg.metrics_port, cfg.device) == (7000, 8001, "cpu")
    (model,) = cfg.models
    assert model.name == "small" and model.attention.variant == "gqa" and model.attention.causal
    assert model.max_seq_len == 128
    assert model.checkpoint == str(tmp_path / "w.safetensors")  # relative to the config file


def test_config_from_environment_variable(tmp_path, monkeypatch):
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text("[server]\ngrace_period_s = 2.5\n")
    monkeypatch.setenv("MHA_SERVE_CONFIG", str(cfg_file))
    args = parser().parse_args([])
    assert build_config(args.config, {}).grace_period_s == 2.5


def test_defaults_without_file():
    cfg = build_config(None, {"port": None})
    assert cfg == ServerConfig()
    assert (cfg.port, cfg.metrics_port) == (50051, 9095)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nprot = 1\n", "unknown [server] keys ['prot']"),
        ("[srv]\n", "unknown top-level keys ['srv']"),
        ("[server]\nport = 70000\n", "port 70000 is not a TCP port"),
        ("[server]\nport = 'x'\n", "port must be int, got 'x'"),
        ("[server]\nmax_send_message_bytes = 10\n", "below 1 MiB"),
        ("[[models]]\nembed_dim = 8\nnum_heads = 2\n", "#1 has no name"),
        (
            "[[models]]\nname = 'a'\nembed_dim = 500\nnum_heads = 8\n",
            "embed_dim 500 is not divisible by num_heads 8",
        ),
        (
            "[[models]]\nname = 'a'\nembed_dim = 64\nnum_heads = 8\nnum_kv_heads = 3\n",
            "num_kv_heads 3 must divide num_heads 8",
        ),
        (
            "[[models]]\nname = 'a'\nembed_dim = 64\nnum_heads = 8\nheads = 3\n",
            "unknown keys ['heads']",
        ),
        ("not toml [", "is not valid TOML"),
        ("[server]\nlog_level = 'loud'\n", "log_level 'LOUD' is not one of DEBUG, INFO"),
        ("[server]\ndtype = 'fp8'\n", "dtype 'fp8' is not one of auto, float32"),
        ("[server]\ndevice = 'tpu'\n", "device 'tpu' is not one of auto, cpu, cuda"),
        ("[server]\ngrace_period_s = -1\n", "grace_period_s -1.0 is negative"),
        ("[server]\nmax_concurrent_rpcs = 0\n", "max_concurrent_rpcs 0 must be at least 1"),
        ("[server]\nfrontend_workers = 0\n", "frontend_workers 0 must be 1..64"),
        ("[server]\nfrontend_workers = 65\n", "frontend_workers 65 must be 1..64"),
        ("[server]\nweights_torch_threads = 0\n", "weights_torch_threads 0 must be at least 1"),
        (
            "[[models]]\nname = 'a'\nembed_dim = 64\nnum_heads = 8\nmax_queue_delay_ms = 5000\n",
            "max_queue_delay_ms must be in 0..1000",
        ),
        (
            "[[models]]\nname = 'a'\nembed_dim = 64\nnum_heads = 8\nkv_cache_dtype = 'fp8'\n",
            "kv_cache_dtype must be one of auto, float32, float16, bfloat16",
        ),
    ],
)
def test_bad_config_exits_2_with_the_fix(tmp_path, capsys, text, message):
    cfg_file = tmp_path / "bad.toml"
    cfg_file.write_text(text)
    assert main(["--config", str(cfg_file)]) == 2
    assert message in capsys.readouterr().err


def test_missing_config_file(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "none.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cuda_without_a_gpu_fails_before_listening(capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert main(["--device", "cuda", "--port", "0", "--metrics-port", "0"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_bad_flag_value(capsys):
    assert main(["--port", "eighty"]) == 2
    assert "port must be int, got 'eighty'" in capsys.readouterr().err


def test_example_config_in_docs_loads():
    from pathlib import Path

    cfg = build_config(str(Path(__file__).parent.parent / "docs/config.example.toml"), {})
    assert [m.name for m in cfg.models] == ["mha", "gqa-1k"]
    assert cfg.models[1].attention.variant == "gqa" and cfg.models[1].attention.causal
    assert [m.kv_cache_dtype for m in cfg.models] == ["auto", "bfloat16"]


def test_example_config_shows_every_key_and_the_server_defaults(tmp_path):
    """docs/config.example.toml sets every [server] key to its default, and names every
    [[models]] key (in a table, or on a commented line); README's flag table lists every
    flag. A key added to the code without its line in the docs fails here."""
    import re
    import tomllib
    from dataclasses import fields
    from pathlib import Path

    from mha_serve.config import SERVER_KEYS
    from mha_serve.model.config import AttentionConfig
    from mha_serve.spec import ModelSpec

    root = Path(__file__).parent.parent
    text = (root / "docs/config.example.toml").read_text()
    server = tomllib.loads(text)["server"]
    defaults = ServerConfig()
    assert sorted(server) == sorted(SERVER_KEYS)
    assert {k: v for k, v in server.items() if getattr(defaults, k) != v} == {}
    model_keys = {f.name for f in fields(ModelSpec) if f.name != "attention"}
    model_keys |= {f.name for f in fields(AttentionConfig)}
    shown = set(re.findall(r"^#? ?([a-z0-9_]+) = ", text.split("[[models]]", 1)[1], flags=re.M))
    assert model_keys - shown == set()
    # the commented family options are values the server takes
    # (ALiBi goes without softcap and sinks: its lines on their own, below)
    alibi = {"alibi", "alibi_bias_max", "alibi_scale", "alibi_bfloat16"}
    # (and MLA with one kv head of its own width: its line is read on its own, below)
    options = {f.name for f in fields(AttentionConfig)} - alibi - {"mla"}

    def uncommented(keys: set[str]) -> AttentionConfig:
        lines = [
            re.sub(r"^# ", "", ln) if ln[2:].split(" ")[0] in keys else ln
            for ln in text.split("\n")
        ]
        example = tmp_path / "options.toml"
        example.write_text("\n".join(lines))
        return build_config(str(example), {}).models[1].attention

    gqa = uncommented(options)
    assert (gqa.sliding_window, gqa.softcap, gqa.qk_norm.scope, gqa.rope.theta) == (
        512,
        50.0,
        "head",
        10000.0,
    )
    assert gqa.output_gate and gqa.output_gate_per_head
    gqa = uncommented(alibi)
    assert (gqa.alibi, gqa.alibi_bias_max, gqa.alibi_scale, gqa.alibi_bfloat16) == (
        True,
        8.0,
        0.125,
        True,
    )
    mla_line = re.search(r"^# (mla = .*)$", text, flags=re.M).group(1)
    mla = AttentionConfig(1024, 16, rope={}, **tomllib.loads(mla_line))
    assert (mla.num_kv_heads, mla.head_dim, mla.mla.q_lora_rank) == (1, 64 + 512, 1536)
    readme = (root / "README.md").read_text().split("## Serving", 1)[1]
    rows = re.findall(r"^\| (`--.*?) \|", readme.split("\n\n| flag |", 1)[1].split("\n\n")[0], re.M)
    flags = {f for row in rows for f in re.findall(r"`--([a-z-]+)", row)}
    assert flags == {k.replace("_", "-") for k in SERVER_KEYS} | {"config"}


def test_mla_table_in_a_config_file(tmp_path):
    """[models.mla] (or mla = { .. }) is read as MLAConfig's fields; a bad key is named."""
    from mha_serve.model.config import MLAConfig

    path = tmp_path / "mla.toml"
    table = (
        '[[models]]\nname = "mla"\nembed_dim = 64\nnum_heads = 4\ncausal = true\n'
        "rope = { theta = 100.0 }\n"
        "[models.mla]\nkv_lora_rank = 32\nrope_dim = 8\nnope_dim = 16\nv_head_dim = 12\n"
    )
    path.write_text(table)
    attention = build_config(str(path), {}).models[0].attention
    assert attention.mla == MLAConfig(32, 8, 16, 12)
    assert (attention.num_kv_heads, attention.head_dim) == (1, 40)
    path.write_text(table + "q_lora_rank = 24\nlora = 3\n")
    with pytest.raises(ValueError, match=r"unknown mla key\(s\) \['lora'\]"):
        build_config(str(path), {})


def test_boolean_settings_from_environment(monkeypatch, capsys):
    monkeypatch.setenv("MHA_SERVE_EVICT_IDLE_SESSIONS", "true")
    assert config_of([]).evict_idle_sessions is True
    monkeypatch.setenv("MHA_SERVE_EVICT_IDLE_SESSIONS", "maybe")
    assert main([]) == 2
    assert "evict_idle_sessions must be bool, got 'maybe'" in capsys.readouterr().err


def test_our_checkpoint_brings_its_config(tmp_path):
    """A [[models]] table naming one of our files needs no attention keys: they come from
    the file's metadata (a pruned or converted model, the family's options included)."""
    import torch

    from mha_serve.config import load_config_file
    from mha_serve.model import AttentionConfig, MultiHeadAttention, save_checkpoint
    from mha_serve.model.config import QKNormConfig, RopeConfig

    config = AttentionConfig(
        48, 5, 1, 12, rope=RopeConfig(), sliding_window=8, qk_norm=QKNormConfig(), softcap=9.0,
        sinks=True,
    )  # fmt: skip
    save_checkpoint(MultiHeadAttention(config), tmp_path / "m.safetensors")
    toml = tmp_path / "models.toml"
    toml.write_text('[[models]]\nname = "m"\ncheckpoint = "m.safetensors"\n')
    _, (spec,) = load_config_file(toml)
    assert spec.attention == config
    torch.save({}, tmp_path / "pickle.pt")  # no safetensors header: refused by name
    toml.write_text('[[models]]\nname = "m"\ncheckpoint = "pickle.pt"\n')
    with pytest.raises(ValueError, match="pickle.pt is not a safetensors file"):
        load_config_file(toml)
    toml.write_text('[[models]]\nname = "m"\ncheckpoint = "absent.safetensors"\n')
    with pytest.raises(ValueError, match="absent.safetensors does not exist"):
        load_config_file(toml)


def test_a_model_of_our_own_takes_the_family_options(tmp_path):
    """sliding_window, qk_norm, softcap, sinks (and rope) in a [[models]] table: a seeded
    model with them serves a stateless call and a session past its window."""
    import torch

    from mha_serve.config import load_config_file
    from mha_serve.engine import Engine
    from tests.engine_calls import attend, req

    toml = tmp_path / "models.toml"
    toml.write_text(
        '[[models]]\nname = "m"\nembed_dim = 48\nnum_heads = 6\nnum_kv_heads = 2\n'
        "causal = true\nsliding_window = 8\nsoftcap = 30.0\nkv_block_size = 4\nsinks = true\n"
        'qk_norm = { scope = "head", eps = 1e-5 }\nrope = { theta = 10000.0 }\n'
    )
    _, (spec,) = load_config_file(toml)
    c = spec.attention
    assert (c.sliding_window, c.softcap, c.qk_norm.eps, c.rope.theta) == (8, 30.0, 1e-5, 1e4)
    assert c.sinks
    engine = Engine(
        [spec], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**24
    )
    x = torch.randn(1, 40, 48)
    whole = attend(engine, req("m", x)).output
    sid = engine.create_session("m").session_id
    for a, b in ((0, 20), (20, 21), (21, 40)):
        got = attend(engine, req("m", x[:, a:b], session_id=sid))
        assert (got.output - whole[:, a:b]).abs().max() < 1e-5
    # 40 tokens: the next step sees positions 33..40, so the blocks of 32..39 are all it keeps
    assert got.session.num_blocks == 2 and got.session.first_position == 32

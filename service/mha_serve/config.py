"""Server settings: built-in defaults < TOML config file < MHA_SERVE_* environment < flags."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mha_serve.model.config import AttentionConfig
from mha_serve.model.hf_config import is_hf_directory, read_hf_layer
from mha_serve.model.metadata import read_config
from mha_serve.spec import DTYPE_NAMES, MiB, ModelSpec

MAX_BUSY_POLL_US = 10_000  # ServerConfig.busy_poll_us at most: 10 ms of spinning a wake-up

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9095
# gRPC's own default receive limit is 4 MiB: too small for one 2048 x 512 fp32 sequence.
DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 64 * MiB
DEFAULT_MAX_SEND_MESSAGE_BYTES = 256 * MiB
DEFAULT_GRACE_PERIOD_S = 10.0
DEFAULT_MAX_CONCURRENT_RPCS = 4096
DEFAULT_SESSION_TTL_S = 600.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DTYPES = ("auto", *DTYPE_NAMES)
MAX_FRONTEND_WORKERS = 64


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT  # gRPC; 0 picks a free port
    metrics_port: int = DEFAULT_METRICS_PORT  # HTTP /metrics; 0 turns it off
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: fp32 on CPU, bf16 on CUDA)
    max_receive_message_bytes: int = DEFAULT_MAX_RECEIVE_MESSAGE_BYTES
    max_send_message_bytes: int = DEFAULT_MAX_SEND_MESSAGE_BYTES
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S  # in-flight calls get this long on SIGTERM
    # On SIGTERM, keep serving this long with health NOT_SERVING so that load balancers
    # stop routing here before the port closes (0: close at once).
    drain_delay_s: float = 0.0
    # Calls handled at once (an open stream counts while open, health checks do not);
    # beyond it RESOURCE_EXHAUSTED, counted (transport/drain.py), and gRPC's own limit a
    # little above it bounds the memory held by requests waiting for a batch.
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS
    torch_threads: int = 0  # intra-op threads for the forward; 0 keeps torch's default
    # Threads of the lane that computes attention weights. Keep torch_threads plus this at
    # most the cores: libgomp slows every op once its threads outnumber them.
    weights_torch_threads: int = 1
    session_ttl_s: float = DEFAULT_SESSION_TTL_S  # idle sessions expire; 0: never
    # When a model's KV cache is full: evict least-recently-used idle sessions (true) or
    # answer RESOURCE_EXHAUSTED (false). An evicted session answers NOT_FOUND saying so.
    evict_idle_sessions: bool = False
    log_level: str = "INFO"
    # --- security and per-client limits (transport/auth.py; docs/api.md "Security") ---
    # Address of the /metrics endpoint; empty: the same as host. (e.g. 127.0.0.1 keeps
    # metrics off the network while the API listens on 0.0.0.0.)
    metrics_host: str = ""
    # TLS on the gRPC port: the server's PEM certificate chain and private key (both or none).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Mutual TLS: PEM CA certificates that sign client certificates; when set, a client
    # without a certificate signed by one of them is refused in the handshake.
    tls_client_ca_file: str = ""
    # A file of bearer tokens, one per line; every call but health must carry
    # "authorization: Bearer <token>". The token may instead come from MHA_SERVE_AUTH_TOKEN.
    auth_token_file: str = ""
    # Per client identity (mTLS certificate name, else bearer token, else peer address):
    # live sessions and KV-cache bytes it may hold; beyond either RESOURCE_EXHAUSTED. 0: no limit.
    max_sessions_per_client: int = 0
    max_cache_bytes_per_client: int = 0
    # Processes that run gRPC, protobuf and the codec, sharing the port (SO_REUSEPORT), in
    # front of one engine process that holds the models, batches and sessions
    # (transport/workers.py). 1: one process does everything, no hop between them.
    frontend_workers: int = 1
    # A lone small request (a decode step, a few tokens) that finds its model's lane idle
    # runs on the event loop's thread, single-threaded, instead of crossing to the compute
    # thread and back (batching/inline.py); concurrent requests still queue and batch.
    inline_lone_requests: bool = True
    # The CPU that the event loop's thread runs on, and gRPC's threads with it (they start
    # from it); the compute threads keep every CPU the process may use. A lone decode step
    # runs on the event loop's thread: pinned, its core's caches still hold the wire's code
    # and the step's weights at the next step, instead of whatever ran on the core the OS
    # woke it on. For a machine (or cpuset) the server has to itself. "none": the OS
    # decides; "auto": the highest-numbered CPU the process may run on (a Kubernetes pod's
    # exclusive cpuset, known only at start); or a CPU's number.
    event_loop_cpu: str = "none"
    # Microseconds a server process's event loop polls without blocking before it sleeps
    # when it runs out of work (transport/busy_poll.py): the next message is taken by a
    # thread that never slept, on a core still warm. Costs up to that much of a core each
    # time the loop idles. For a machine the server has to itself; 0: off.
    busy_poll_us: int = 0
    # On CUDA, let attention run cuDNN's kernel. It builds a plan for every new shape
    # (35-50 ms of host time each on an H200), and sessions grow by a token a step, so it is
    # off: flash and memory-efficient kernels need no plan (engine.choose_attention_kernels).
    cudnn_attention: bool = False
    # On CUDA, plain decode steps (one token, no weights, no head mask) run in fixed shapes
    # replayed from CUDA graphs, one per batch bucket and key width (engine/graphs.py): a
    # step's host work is most of its cost on a GPU. Off until a GPU run measures it served.
    decode_graphs: bool = False
    # On CUDA, a batch of decode steps (one token each, no weights, no head mask) of a
    # float16/bfloat16 model reads each session's K/V where it lies in the cache, in one
    # flash attention kernel (engine/attend.py), instead of copying them into a padded batch
    # first. Off until a GPU run measures it served.
    flash_decode: bool = False
    # --- durable sessions (docs/operations.md "Durable sessions") ---
    # A directory where a full KV cache moves its least recently used idle sessions instead of
    # refusing or evicting them, and where live sessions are written on SIGTERM (after
    # draining); a server started on it adopts them. One live server per directory. Empty: off.
    session_spill_dir: str = ""
    # Bytes of session files the directory may hold; past it the oldest spilled sessions
    # expire (NOT_FOUND, saying so). Required with session_spill_dir.
    session_spill_bytes: int = 0
    # --- tracing (docs/operations.md "Tracing") ---
    # An OTLP/HTTP traces endpoint (e.g. http://otel-collector:4318/v1/traces): every call
    # is a span there, a child of the client's when its metadata carries W3C traceparent
    # (transport/tracing.py; the `tracing` extra). Empty: off, and free.
    tracing_endpoint: str = ""
    # The share of the traces that start here (no sampled traceparent from the client) that
    # are recorded; a client's traceparent decides for its own.
    tracing_sample_ratio: float = 1.0
    models: list[ModelSpec] = field(default_factory=lambda: default_models())


def default_models() -> list[ModelSpec]:
    """The built-in models: one size, three variants side by side."""
    return [
        ModelSpec("mha", AttentionConfig(embed_dim=512, num_heads=8, num_kv_heads=8), seed=1),
        ModelSpec("gqa", AttentionConfig(embed_dim=512, num_heads=8, num_kv_heads=2), seed=2),
        ModelSpec("mqa", AttentionConfig(embed_dim=512, num_heads=8, num_kv_heads=1), seed=3),
    ]


SERVER_KEYS = {f.name: f.type for f in fields(ServerConfig) if f.name != "models"}
_ATTENTION_KEYS = {f.name for f in fields(AttentionConfig)}
_SPEC_KEYS = {f.name for f in fields(ModelSpec)} - {"attention", "name"}


def load_config_file(path: str | Path) -> tuple[dict[str, Any], list[ModelSpec] | None]:
    """Reads a TOML file: a [server] table of ServerConfig keys and [[models]] tables."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    unknown = set(data) - {"server", "models"}
    if unknown:
        raise ValueError(
            f"{path}: unknown top-level keys {sorted(unknown)}; use [server] and [[models]]"
        )
    server = data.get("server", {})
    bad = set(server) - set(SERVER_KEYS)
    if bad:
        raise ValueError(
            f"{path}: unknown [server] keys {sorted(bad)}; valid: {sorted(SERVER_KEYS)}"
        )
    models = None
    if "models" in data:
        models = [
            _relative_checkpoint(_model_spec(entry, path, i), path.parent)
            for i, entry in enumerate(data["models"])
        ]
    return server, models


def _model_spec(entry: dict[str, Any], path: Path, index: int) -> ModelSpec:
    where = f"{path}: [[models]] #{index + 1}"
    if "name" not in entry:
        raise ValueError(f"{where} has no name")
    bad = set(entry) - _ATTENTION_KEYS - _SPEC_KEYS - {"name"}
    if bad:
        raise ValueError(
            f"{where} ({entry['name']}): unknown keys {sorted(bad)}; valid: "
            f"{sorted(_ATTENTION_KEYS | _SPEC_KEYS | {'name'})}"
        )
    try:
        attention = _hf_attention(entry, path.parent) or _stored_attention(entry, path.parent)
        if attention is None:
            attention = AttentionConfig(**{k: v for k, v in entry.items() if k in _ATTENTION_KEYS})
        return ModelSpec(
            name=entry["name"],
            attention=attention,
            **{k: v for k, v in entry.items() if k in _SPEC_KEYS},
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} ({entry['name']}): {e}") from None


def _hf_attention(entry: dict[str, Any], base: Path) -> AttentionConfig | None:
    """A Hugging Face model directory's layer: its attention comes from its config.json
    (None for any other model); `layer` belongs to such a directory alone."""
    checkpoint = entry.get("checkpoint")
    if not isinstance(checkpoint, str) or not is_hf_directory(base / checkpoint):
        if "layer" in entry:
            raise ValueError(
                f"layer is for a Hugging Face model directory, but checkpoint is {checkpoint!r}"
            )
        return None
    given = sorted(set(entry) & _ATTENTION_KEYS)
    if given:
        raise ValueError(
            f"{checkpoint} is a Hugging Face model directory, whose config.json sets the "
            f"attention: remove {given} from the table"
        )
    return read_hf_layer(base / checkpoint, entry.get("layer")).attention


def _stored_attention(entry: dict[str, Any], base: Path) -> AttentionConfig | None:
    """The config in one of our checkpoint files' metadata, when the table gives no
    attention keys of its own (given ones must agree with the file, at load)."""
    checkpoint = entry.get("checkpoint")
    if not isinstance(checkpoint, str) or set(entry) & _ATTENTION_KEYS:
        return None
    path = base / checkpoint
    if not path.is_file():
        raise ValueError(
            f"checkpoint {path} does not exist (give its embed_dim and num_heads in the table "
            "for a file written later)"
        )
    config = read_config(path)
    if config is None:
        raise ValueError(
            f"{checkpoint} carries no attention config in its metadata (an nn.MultiheadAttention "
            "state_dict, say): give embed_dim and num_heads in the table"
        )
    return config


def _relative_checkpoint(spec: ModelSpec, base: Path) -> ModelSpec:
    """Checkpoint paths in a config file are relative to that file."""
    if not spec.checkpoint or Path(spec.checkpoint).is_absolute():
        return spec
    return replace(spec, checkpoint=str(base / spec.checkpoint))


def coerce(key: str, value: Any) -> Any:
    """Converts a flag, environment or file value to the type ServerConfig declares."""
    kind = SERVER_KEYS[key]
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be {kind}, got {value!r}") from None


def build_config(file_path: str | None, overrides: dict[str, Any]) -> ServerConfig:
    """File values, then non-None overrides (environment and flags, already merged)."""
    cfg = ServerConfig()
    if file_path:
        server, models = load_config_file(file_path)
        for key, value in server.items():
            setattr(cfg, key, coerce(key, value))
        if models is not None:
            cfg.models = models
    for key, value in overrides.items():
        if value is not None:
            setattr(cfg, key, coerce(key, value))
    for key in ("port", "metrics_port"):
        if not 0 <= getattr(cfg, key) <= 65535:
            raise ValueError(f"{key} {getattr(cfg, key)} is not a TCP port (0..65535)")
    for key in ("max_receive_message_bytes", "max_send_message_bytes"):
        if getattr(cfg, key) < MiB:
            raise ValueError(f"{key} {getattr(cfg, key)} is below 1 MiB; raise it")
    for key in ("grace_period_s", "drain_delay_s", "torch_threads", "session_ttl_s"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key} {getattr(cfg, key)} is negative; use 0 or more")
    if cfg.weights_torch_threads < 1:
        raise ValueError(f"weights_torch_threads {cfg.weights_torch_threads} must be at least 1")
    if not 1 <= cfg.frontend_workers <= MAX_FRONTEND_WORKERS:
        raise ValueError(
            f"frontend_workers {cfg.frontend_workers} must be 1..{MAX_FRONTEND_WORKERS}"
        )
    if cfg.session_spill_bytes < 0:
        raise ValueError(f"session_spill_bytes {cfg.session_spill_bytes} is negative")
    if cfg.session_spill_dir and not cfg.session_spill_bytes:
        raise ValueError(
            "session_spill_dir is set but session_spill_bytes is 0: give the spill tier a "
            "byte budget (e.g. --session-spill-bytes 8589934592 for 8 GiB)"
        )
    cfg.event_loop_cpu = cfg.event_loop_cpu.strip().lower()
    if not (cfg.event_loop_cpu in ("none", "auto") or cfg.event_loop_cpu.isdigit()):
        raise ValueError(
            f"event_loop_cpu {cfg.event_loop_cpu!r} is not none, auto or a CPU's number (0, 1, ...)"
        )
    if cfg.event_loop_cpu != "none" and cfg.frontend_workers > 1:
        raise ValueError(
            "event_loop_cpu pins one process's event loop; with frontend_workers > 1 the "
            "gRPC event loops run in several processes: pin the processes instead (taskset, "
            "or the orchestrator's CPU sets)"
        )
    if not 0 <= cfg.busy_poll_us <= MAX_BUSY_POLL_US:
        raise ValueError(
            f"busy_poll_us {cfg.busy_poll_us} must be 0 (off) to {MAX_BUSY_POLL_US} (10 ms)"
        )
    if cfg.tracing_endpoint and not re.match(r"https?://[^/\s]+", cfg.tracing_endpoint):
        raise ValueError(
            f"tracing_endpoint {cfg.tracing_endpoint!r} is not an http:// or https:// URL "
            "(an OTLP/HTTP traces endpoint, e.g. http://otel-collector:4318/v1/traces)"
        )
    if cfg.tracing_endpoint and urlsplit(cfg.tracing_endpoint).path in ("", "/"):
        # (the exporter posts to the URL as given; OTEL_EXPORTER_OTLP_ENDPOINT's /v1/traces
        # is added only to that variable's base URL)
        raise ValueError(
            f"tracing_endpoint {cfg.tracing_endpoint!r} has no path: an OTLP/HTTP collector "
            f"takes traces at /v1/traces ({cfg.tracing_endpoint.rstrip('/')}/v1/traces)"
        )
    if not 0.0 <= cfg.tracing_sample_ratio <= 1.0:
        raise ValueError(f"tracing_sample_ratio {cfg.tracing_sample_ratio} must be 0 to 1")
    if cfg.max_concurrent_rpcs < 1:
        raise ValueError(f"max_concurrent_rpcs {cfg.max_concurrent_rpcs} must be at least 1")
    cfg.log_level = cfg.log_level.upper()
    if cfg.log_level not in LOG_LEVELS:
        raise ValueError(f"log_level {cfg.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype {cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    if cfg.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?|mps", cfg.device):
        raise ValueError(f"device {cfg.device!r} is not one of auto, cpu, cuda, cuda:N, mps")
    check_security(cfg)
    return cfg


def check_security(cfg: ServerConfig) -> None:
    """TLS files come in pairs, can be read and load (check_tls_files); the token file can
    be read; per-client limits are not negative."""
    if bool(cfg.tls_cert_file) != bool(cfg.tls_key_file):
        raise ValueError(
            "tls_cert_file and tls_key_file go together: give both (TLS) or neither (plaintext)"
        )
    if cfg.tls_client_ca_file and not cfg.tls_cert_file:
        raise ValueError(
            "tls_client_ca_file (mutual TLS) needs the server's own tls_cert_file and tls_key_file"
        )
    for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_token_file"):
        path = getattr(cfg, key)
        if path and not Path(path).is_file():
            raise ValueError(f"{key} {path!r} is not a readable file")
        if path:
            try:
                Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"{key} {path!r} is not a readable file: {e.strerror}") from e
    check_tls_files(cfg)
    for key in ("max_sessions_per_client", "max_cache_bytes_per_client"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key} {getattr(cfg, key)} is negative; use 0 (no limit) or more")


def check_tls_files(cfg: ServerConfig) -> None:
    """Loads the TLS files as OpenSSL reads them, so that a file that is no PEM certificate
    chain, a key that is not the chain's, or CA certificates that do not load are refused
    at start, naming the file (the gRPC port loads them only when it opens: in a frontend
    worker, after the models, as a frontend that dies and is started again)."""
    if not cfg.tls_cert_file:
        return
    import ssl  # (only with TLS)

    def encrypted() -> bytes:
        raise ValueError(
            f"tls_key_file {cfg.tls_key_file!r} is encrypted: gRPC needs an unencrypted "
            "PEM private key (keep it readable by the server's user only)"
        )

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # the chain alone first: then a failure of the pair is the key's
        context.load_verify_locations(cafile=cfg.tls_cert_file)
    except ssl.SSLError as e:
        raise ValueError(
            f"tls_cert_file {cfg.tls_cert_file!r} holds no PEM certificate chain: {e}"
        ) from e
    try:
        context.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file, password=encrypted)
    except ssl.SSLError as e:
        raise ValueError(
            f"tls_key_file {cfg.tls_key_file!r} is not the PEM private key of tls_cert_file "
            f"{cfg.tls_cert_file!r}, or that file is no PEM certificate chain: {e}"
        ) from e
    if cfg.tls_client_ca_file:
        try:
            context.load_verify_locations(cafile=cfg.tls_client_ca_file)
        except ssl.SSLError as e:
            raise ValueError(
                f"tls_client_ca_file {cfg.tls_client_ca_file!r} holds no PEM CA certificates: {e}"
            ) from e

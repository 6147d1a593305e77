"""The `mha-serve` command: flags (or MHA_SERVE_* variables) and a TOML config file."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys

# (Only the standard library before main() has its stop signals in place: early_stop.py.)
from mha_serve.transport.early_stop import EarlyStop

ENV_PREFIX = "MHA_SERVE_"
HELP = {
    "host": "address to listen on (gRPC, and metrics unless --metrics-host)",
    "port": "gRPC port; 0 picks a free one",
    "metrics_port": "HTTP port of /metrics; 0 turns it off",
    "device": "auto | cpu | cuda | cuda:N | mps (auto: CUDA when available)",
    "dtype": "auto | float32 | float16 | bfloat16 (auto: float32 on CPU, bfloat16 on CUDA)",
    "max_receive_message_bytes": "largest request accepted",
    "max_send_message_bytes": "largest response sent (bounds embeddings + attention weights)",
    "grace_period_s": "seconds in-flight calls get to finish on SIGTERM/SIGINT",
    "torch_threads": "torch threads of the compute thread (loading and every batched lane); 0 keeps torch's default",
    "weights_torch_threads": "torch threads of the attention-weights lane; torch_threads plus this should not exceed the cores",
    "drain_delay_s": "on SIGTERM, seconds to keep serving with health NOT_SERVING before closing",
    "max_concurrent_rpcs": "calls handled at once (an open stream counts while open, health checks do not); beyond it RESOURCE_EXHAUSTED",
    "session_ttl_s": "idle KV-cache sessions expire after this many seconds; 0: never",
    "evict_idle_sessions": "when a KV cache is full, evict least-recently-used idle sessions (true) or refuse (false)",
    "log_level": "DEBUG | INFO | WARNING | ERROR",
    "metrics_host": "address of /metrics; empty: the same as --host (e.g. 127.0.0.1 keeps metrics local)",
    "tls_cert_file": "PEM certificate chain of the gRPC port (TLS); with --tls-key-file",
    "tls_key_file": "PEM private key of --tls-cert-file",
    "tls_client_ca_file": "PEM CA certificates of client certificates: mutual TLS, a client without one is refused",
    "auth_token_file": "file of bearer tokens, one per line, required on every call but health (or the token in MHA_SERVE_AUTH_TOKEN)",
    "max_sessions_per_client": "live sessions one client (certificate, token or peer address) may hold; 0: no limit",
    "max_cache_bytes_per_client": "KV-cache bytes one client's sessions may hold; 0: no limit",
    "frontend_workers": "processes serving gRPC on the port in front of one engine process (1: one process; docs/operations.md)",
    "session_spill_dir": "directory for sessions a full KV cache moves out and SIGTERM writes; a server started on it adopts them (empty: off; one live server per directory)",
    "session_spill_bytes": "byte budget of the spill directory; past it the oldest spilled sessions expire",
    "cudnn_attention": "on CUDA, let attention run cuDNN's kernel, which builds a plan of 35-50 ms for every new shape (a growing session's every step); off: flash or memory-efficient kernels",
    "decode_graphs": "on CUDA, decode steps run in fixed shapes replayed from CUDA graphs (one per batch bucket and key width); off: as any step",
    "flash_decode": "on CUDA, batched decode steps of a float16/bfloat16 model read each session's K/V in place in one flash attention kernel; off: copied into a padded batch first",
    "event_loop_cpu": "none | auto | N: the CPU the event loop's thread (and gRPC's) runs on, for a machine the server has to itself (auto: the last CPU the process may use); the compute threads keep every CPU (docs/operations.md)",
    "busy_poll_us": "microseconds the event loop polls without sleeping when it runs out of work, so the next message (a decode step) is taken by a warm thread; costs up to that much of a core per idle moment, for a machine the server has to itself; 0: off (docs/operations.md)",
    "tracing_endpoint": "OTLP/HTTP traces endpoint (e.g. http://otel-collector:4318/v1/traces): every call a span, a child of the client's W3C traceparent; needs pip install 'mha-serve[tracing]'; empty: off",
    "tracing_sample_ratio": "share of the traces that start here (no traceparent from the client) recorded, 0 to 1",
    "inline_lone_requests": "a lone small request (a decode step) that finds its lane idle runs on the event loop's thread, no thread crossing; false: every request crosses to the compute thread",
}


def parser() -> argparse.ArgumentParser:
    from mha_serve.config import SERVER_KEYS, ServerConfig

    defaults = ServerConfig()
    p = argparse.ArgumentParser(
        prog="mha-serve",
        description="Serve multi-head attention (MHA, GQA, MQA) over gRPC. Every flag can also be "
        "set by an environment variable MHA_SERVE_<FLAG> (e.g. MHA_SERVE_PORT); flags win over "
        "the environment, which wins over --config, which wins over the built-in defaults.",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=os.environ.get(ENV_PREFIX + "CONFIG"),
        help="TOML file with [server] settings and [[models]] (default: built-in mha, gqa, mqa)",
    )
    for key in SERVER_KEYS:
        env = ENV_PREFIX + key.upper()
        p.add_argument(
            "--" + key.replace("_", "-"),
            dest=key,
            default=os.environ.get(env),
            metavar=SERVER_KEYS[key].upper(),
            help=f"{HELP[key]} (default {getattr(defaults, key)!r}; env {env})",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    # First of all: a SIGTERM/SIGINT while torch imports and the models load stops the
    # server once it can, with exit 0, instead of killing it (early_stop.py).
    with EarlyStop() as early:
        return _main(argv, early)


def _main(argv: list[str] | None, early: EarlyStop) -> int:
    from mha_serve.config import SERVER_KEYS, build_config
    from mha_serve.transport.run_dirs import remove_stale_run_dirs

    args = parser().parse_args(argv)
    overrides = {key: getattr(args, key) for key in SERVER_KEYS}
    try:
        cfg = build_config(args.config, overrides)
    except ValueError as e:
        print(f"mha-serve: configuration error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    remove_stale_run_dirs()  # those of servers killed before they could (run_dirs.py)
    if cfg.frontend_workers <= 1:
        return _serve(cfg, early)
    try:
        owned = _multiprocess_metrics()
    except OSError as e:
        print(f"mha-serve: configuration error: {e}", file=sys.stderr)
        return 2
    try:
        return _serve(cfg, early)
    finally:  # (on every way out: a signal before serving and a bad device too)
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
            os.environ.pop(METRICS_DIR_ENV, None)


def _serve(cfg, early: EarlyStop) -> int:
    from mha_serve.transport import busy_poll, tracing

    try:  # torch loads here, after the flags are checked
        from mha_serve.engine import resolve_device
        from mha_serve.transport.server import serve
    except ImportError as e:
        print(
            f"mha-serve: {e}; the server needs its extra: pip install 'mha-serve[server]'",
            file=sys.stderr,
        )
        return 2
    try:
        resolve_device(cfg.device)
        tracing.check_installed(cfg.tracing_endpoint)
    except (ValueError, RuntimeError) as e:
        print(f"mha-serve: configuration error: {e}", file=sys.stderr)
        return 2
    if early.received:
        logging.getLogger("mha-serve").info("stopped by a signal before serving")
        return 0

    if cfg.frontend_workers > 1:
        return _run_frontend_workers(cfg, early)
    try:
        busy_poll.run(serve(cfg, early), cfg.busy_poll_us)
    except (ValueError, OSError) as e:
        logging.getLogger("mha-serve").error("cannot start: %s", e)
        return 1
    return 0


def _multiprocess_metrics() -> str | None:
    """Frontend workers share prometheus-client's multiprocess mode: its directory is set
    here, before prometheus_client is first imported in this process or in a frontend
    (they inherit the environment). The directory when this made it (removed at exit),
    None when PROMETHEUS_MULTIPROC_DIR named one; OSError saying which when it is unusable."""
    from mha_serve.transport.run_dirs import make_run_dir

    owned = None
    if not os.environ.get(METRICS_DIR_ENV):
        owned = str(make_run_dir("mha-serve-metrics-"))
        os.environ[METRICS_DIR_ENV] = owned
    metrics_dir = os.environ[METRICS_DIR_ENV]
    try:  # files of an earlier run would add to this one's counts
        for stale in os.listdir(metrics_dir):
            if stale.endswith(".db"):
                os.unlink(os.path.join(metrics_dir, stale))
    except OSError as e:
        raise OSError(f"{METRICS_DIR_ENV}={metrics_dir}: {e}") from e
    return owned


def _run_frontend_workers(cfg, early: EarlyStop) -> int:
    """The engine process and its frontends (transport/workers.py)."""
    from mha_serve.transport.workers import run

    try:
        return run(cfg, early)
    except (ValueError, OSError) as e:
        logging.getLogger("mha-serve").error("cannot start: %s", e)
        return 1


# prometheus-client's multiprocess directory
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


if __name__ == "__main__":
    sys.exit(main())

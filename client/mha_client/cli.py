"""mha-client: list models, check health and run attention against any mha-serve server.

Exit status: 0 on success, 1 when the server (or a file) fails, 2 for usage errors, 130 when
Ctrl-C stops it (`load` prints what it measured until then).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import grpc
import numpy as np

from mha_client.channel import ChannelSecurity
from mha_client.cli_heads import add_heads_command
from mha_client.cli_load import EXIT_INTERRUPTED, add_load_arguments, cmd_load
from mha_client.cli_save import SAVE_HELP, save_path, save_result
from mha_client.cli_sessions import add_session_commands
from mha_client.cli_types import UsageError, float_list, int_list, positive_float, read_input
from mha_client.errors import InvalidArgumentError, MhaServeError
from mha_client.heatmap import require_matplotlib, save_heatmap
from mha_client.report import (
    attend_summary,
    format_attend_summary,
    format_fields,
    models_table,
)
from mha_client.sdk import DEFAULT_TARGET, AttendResult, Client
from mha_client.tensors import DTYPE_NAMES, default_wire_dtype

ENV_TARGET = "MHA_CLIENT_TARGET"
ENV_TOKEN = "MHA_CLIENT_TOKEN"  # a bearer token, when no --token-file is given
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_TIMEOUT_S = 60.0


# ----- argument types: each raises ArgumentTypeError, so argparse exits 2 with the reason


def row_range(text: str) -> tuple[int, int | None]:
    """Parse "2:7" into (2, 7); "2:" gives (2, None) (to the end), ":7" gives (0, 7)."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        lo = int(start) if start.strip() else 0
        hi = int(end) if end.strip() else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a row range START:END, e.g. 2:7 (either side may be left out)"
        ) from None
    if lo < 0:
        raise argparse.ArgumentTypeError(
            f"rows {text!r} start at {lo}: rows count from 0, so START must be >= 0 "
            f"(0 <= START < END)"
        )
    if hi is not None and hi <= lo:
        raise argparse.ArgumentTypeError(
            f"rows {text!r} are empty: END must be greater than START (0 <= START < END)"
        )
    return lo, hi


def random_shape(text: str) -> tuple[int, ...]:
    """Parse "2,5" into (2, 5) (batch, seq_len), or "5" into (5,) (one sequence)."""
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) not in (1, 2) or min(dims) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape BATCH,SEQ_LEN or SEQ_LEN of positive integers, e.g. 2,16"
        )
    return dims


def prune_mask(prune: Sequence[int], num_heads: int) -> list[float]:
    """A head mask of num_heads ones with zeros at the pruned heads."""
    bad = [h for h in prune if not 0 <= h < num_heads]
    if bad:
        raise UsageError(
            f"--prune-heads {bad} out of range: the model has {num_heads} heads (0..{num_heads - 1})"
        )
    pruned = set(prune)
    return [0.0 if h in pruned else 1.0 for h in range(num_heads)]


# ----- parser


def add_security_arguments(p: argparse.ArgumentParser, suppress: bool) -> None:
    """TLS, mutual TLS and bearer-token flags (ChannelSecurity)."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    p.add_argument(
        "--tls",
        action="store_true",
        default=default(False),
        help="TLS with the system's root certificates (--ca-file implies it)",
    )
    p.add_argument(
        "--ca-file", metavar="PEM", default=default(None), help="CA certificates of the server's"
    )
    p.add_argument(
        "--cert-file",
        metavar="PEM",
        default=default(None),
        help="this client's certificate (mutual TLS; with --key-file)",
    )
    p.add_argument("--key-file", metavar="PEM", default=default(None), help="its private key")
    p.add_argument(
        "--token-file",
        metavar="FILE",
        default=default(None),
        help=f"file holding a bearer token (default: the token in ${ENV_TOKEN}, if set)",
    )


def security_of(args: argparse.Namespace) -> ChannelSecurity:
    return ChannelSecurity.from_files(
        tls=args.tls,
        ca_file=args.ca_file,
        cert_file=args.cert_file,
        key_file=args.key_file,
        token_file=args.token_file,
        token=os.environ.get(ENV_TOKEN),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mha-client", description="Talk to an mha-serve server (attention over gRPC)."
    )
    # The same flags on every subcommand, defaulting to "not given" so that
    # `mha-client --target X attend ...` and `mha-client attend ... --target X` both work.
    common = argparse.ArgumentParser(add_help=False)
    for p, suppress in ((parser, False), (common, True)):
        p.add_argument(
            "--target",
            metavar="HOST:PORT",
            default=argparse.SUPPRESS if suppress else os.environ.get(ENV_TARGET, DEFAULT_TARGET),
            help=f"server address (default: ${ENV_TARGET}, else {DEFAULT_TARGET})",
        )
        p.add_argument(
            "--timeout",
            type=positive_float,
            metavar="SECONDS",
            default=argparse.SUPPRESS if suppress else DEFAULT_TIMEOUT_S,
            help=f"deadline per call (default {DEFAULT_TIMEOUT_S:g})",
        )
        p.add_argument(
            "--application",
            metavar="NAME",
            default=argparse.SUPPRESS if suppress else "",
            help="the Ray Serve application to reach, when a Ray cluster's gRPC proxy serves "
            "several (sent as the 'application' metadata; docs/ray.md)",
        )
        add_security_arguments(p, suppress)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = sub.add_parser("models", parents=[common], help="list hosted models")
    models.add_argument("--json", action="store_true", help="print JSON")
    models.set_defaults(func=cmd_models)

    info = sub.add_parser("info", parents=[common], help="every field of one model")
    info.add_argument("name", help="model name, as `mha-client models` lists")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=cmd_info)

    health = sub.add_parser("health", parents=[common], help="SERVING or NOT_SERVING")
    health.add_argument("--service", default="", help="health service name (default: server)")
    health.add_argument(
        "--wait",
        type=positive_float,
        metavar="SECONDS",
        help="poll until SERVING for up to this long",
    )
    health.set_defaults(func=cmd_health)

    attend = sub.add_parser("attend", parents=[common], help="run attention on an input")
    attend.add_argument("model", help="model name, as `mha-client models` lists")
    source = attend.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        type=Path,
        metavar="FILE.npy",
        help="(seq_len, embed_dim) or (batch, seq_len, embed_dim) floats",
    )
    source.add_argument(
        "--random-shape",
        type=random_shape,
        metavar="B,L",
        help="random normal input of B sequences of L tokens (or just L)",
    )
    attend.add_argument("--seed", type=int, default=0, help="seed for --random-shape")
    attend.add_argument(
        "--lengths",
        type=int_list,
        metavar="N,N,...",
        help="real length of each sequence; the rest is padding",
    )
    mode = attend.add_mutually_exclusive_group()
    mode.add_argument(
        "--causal",
        dest="causal",
        action="store_const",
        const=True,
        help="each token attends to itself and earlier ones (default: the model's)",
    )
    mode.add_argument(
        "--bidirectional",
        dest="causal",
        action="store_const",
        const=False,
        help="each token attends to every real token",
    )
    attend.add_argument("--weights", action="store_true", help="return attention weights")
    attend.add_argument("--heads", type=int_list, metavar="H,H,...", help="weights of these heads")
    attend.add_argument(
        "--rows", type=row_range, metavar="START:END", help="weights of these query rows"
    )
    attend.add_argument(
        "--weights-dtype",
        choices=list(DTYPE_NAMES),
        help="dtype of returned weights (default float32)",
    )
    mask = attend.add_mutually_exclusive_group()
    mask.add_argument(
        "--head-mask",
        type=float_list,
        metavar="G,G,...",
        help="one gate per head multiplying its output (0 prunes it)",
    )
    mask.add_argument(
        "--prune-heads",
        type=int_list,
        metavar="H,H,...",
        help="heads to prune (a head mask with zeros there)",
    )
    attend.add_argument("--dtype", choices=list(DTYPE_NAMES), help="input dtype on the wire")
    attend.add_argument(
        "--output-dtype",
        choices=list(DTYPE_NAMES),
        help="dtype of returned embeddings (default: the input's)",
    )
    attend.add_argument("--save", type=save_path, metavar="OUT.npz|OUT.npy", help=SAVE_HELP)
    attend.add_argument(
        "--heatmap",
        type=Path,
        metavar="OUT.png",
        help="weights of the first sequence as a PNG (implies --weights)",
    )
    attend.add_argument("--json", action="store_true", help="print a JSON summary")
    attend.set_defaults(func=cmd_attend)

    add_session_commands(sub, common)
    add_heads_command(sub, common)

    load = sub.add_parser("load", parents=[common], help="load test: throughput and latency")
    add_load_arguments(load)
    load.set_defaults(func=cmd_load)
    return parser


# ----- commands


def cmd_models(client: Client, args: argparse.Namespace) -> int:
    models = client.list_models()
    if args.json:
        print(json.dumps([asdict(m) for m in models], indent=2))
        return EXIT_OK
    print(models_table(models))
    return EXIT_OK


def cmd_info(client: Client, args: argparse.Namespace) -> int:
    info = asdict(client.model_info(args.name))
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    cache = info.pop("kv_cache")  # one line per field: kv_cache.dtype, ...
    pairs = list(info.items())
    pairs += (
        [("kv_cache", "none")]
        if cache is None
        else [(f"kv_cache.{k}", v) for k, v in cache.items()]
    )
    print(format_fields(pairs))
    return EXIT_OK


def cmd_health(client: Client, args: argparse.Namespace) -> int:
    if args.wait is not None:
        try:
            client.wait_ready(args.wait, args.service)
        except TimeoutError as err:
            print("NOT_SERVING")
            print(f"error: {err}", file=sys.stderr)
            return EXIT_FAILED
    try:
        status = client.health(args.service)
    except MhaServeError as err:
        if err.code != grpc.StatusCode.NOT_FOUND:
            raise
        # grpc.health.v1 says NOT_FOUND, with no message, for a service it does not know.
        print(
            f"error: the server has no health service {args.service!r} "
            f"(--service; leave it out for the whole server)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(status)
    return EXIT_OK if status == "SERVING" else EXIT_FAILED


def _load_input(client: Client, args: argparse.Namespace) -> np.ndarray:
    if args.random_shape is not None:
        embed_dim = client.model_info(args.model).embed_dim
        rng = np.random.default_rng(args.seed)
        return rng.standard_normal((*args.random_shape, embed_dim), dtype=np.float32)
    return read_input(args.input)


def _real_lengths(x: np.ndarray, lengths: list[int] | None) -> np.ndarray:
    batch = 1 if x.ndim == 2 else x.shape[0]
    return np.asarray(lengths if lengths else [x.shape[-2]] * batch, dtype=np.int32)


def _heatmap(path: Path, result: AttendResult, lengths: np.ndarray) -> None:
    if result.weights is None:
        raise ValueError(f"the server returned no attention weights for {result.model}")
    first = result.weights if result.weights.ndim == 3 else result.weights[0]  # (h, R, S)
    length = int(lengths[0])
    num_rows = max(0, min(first.shape[1], length - result.weight_query_start))
    if num_rows == 0:
        raise UsageError(
            f"the first sequence ({length} tokens) has no rows in --rows; pick rows below {length}"
        )
    title = f"{result.model}: sequence 0, {length} tokens"
    save_heatmap(
        first[:, :num_rows, :length],
        result.weight_heads,
        path,
        title=title,
        query_start=result.weight_query_start,
    )


def cmd_attend(client: Client, args: argparse.Namespace) -> int:
    want_weights = args.weights or args.heatmap is not None
    if not want_weights and (args.heads or args.rows or args.weights_dtype):
        raise UsageError("--heads, --rows and --weights-dtype select weights: add --weights")
    if args.heatmap is not None:
        require_matplotlib()  # before the call, not after the server did the work
    x = _load_input(client, args)
    head_mask = args.head_mask
    if args.prune_heads is not None:
        head_mask = prune_mask(args.prune_heads, client.model_info(args.model).num_heads)
    result = client.attend(
        args.model,
        x,
        lengths=args.lengths,
        causal=args.causal,
        weights=want_weights,
        heads=args.heads,
        query_range=args.rows,
        weights_dtype=args.weights_dtype,
        head_mask=head_mask,
        output_dtype=args.output_dtype,
        input_dtype=args.dtype,
    )
    lengths = _real_lengths(x, args.lengths)
    if args.save is not None:
        save_result(args.save, result, lengths)
    if args.heatmap is not None:
        _heatmap(args.heatmap, result, lengths)
    wire_dtype = args.dtype or default_wire_dtype(x)
    files = {k: str(v) for k, v in (("saved", args.save), ("heatmap", args.heatmap)) if v}
    summary = attend_summary(result, x, lengths, wire_dtype, files)
    print(json.dumps(summary, indent=2) if args.json else format_attend_summary(summary))
    return EXIT_OK


def _report(err: MhaServeError, target: str) -> None:
    print(f"error: {err}", file=sys.stderr)
    if isinstance(err, InvalidArgumentError):
        print("mha-client refused this before sending it: the server saw nothing", file=sys.stderr)
    elif err.code == grpc.StatusCode.UNAVAILABLE:
        print(
            f"mha-serve at {target} cannot be reached or is not accepting requests; "
            f"is it running? pass --target HOST:PORT or set {ENV_TARGET}",
            file=sys.stderr,
        )
    elif err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        print("the call ran past --timeout; raise it or send less", file=sys.stderr)
    elif err.code == grpc.StatusCode.UNIMPLEMENTED:
        print(
            f"the server at {target} does not offer this call; is it mha-serve, and of a "
            f"version that matches this client?",
            file=sys.stderr,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `mha-client`; returns the exit status instead of exiting."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        metadata = (("application", args.application),) if args.application else ()
        with Client(
            args.target, timeout=args.timeout, security=security_of(args), metadata=metadata
        ) as client:
            return args.func(client, args)
    except UsageError as err:
        print(f"{parser.prog} {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except MhaServeError as err:
        _report(err, args.target)
        return EXIT_FAILED
    except (ImportError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

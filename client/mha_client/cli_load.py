"""`mha-client load`: its arguments and the command (cli.py registers them; the generator is
mha_client.loadgen)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from mha_client.cli_types import (
    UsageError,
    fraction,
    non_negative_int,
    positive_float,
    positive_int,
)
from mha_client.loadgen import (
    GrpcTarget,
    LoadSpec,
    SeqLens,
    Workload,
    parse_seq_lens,
    run_load_sync,
)

DEFAULT_CLI_DURATION_S = 10.0  # `mha-client load` with neither --requests nor --duration
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


def _seq_lens_arg(text: str) -> SeqLens:
    try:
        return parse_seq_lens(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _rate_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of requests/s")
    return value


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model name, as `mha-client models` lists")
    loop = p.add_mutually_exclusive_group()
    loop.add_argument("--concurrency", type=positive_int, help="closed loop: N clients (default 1)")
    loop.add_argument("--rate", type=_rate_arg, help="open loop: requests per second")
    p.add_argument(
        "--arrivals",
        choices=["poisson", "uniform"],
        help="open-loop (--rate) arrival process (default poisson)",
    )
    p.add_argument("--requests", type=positive_int, help="measured requests (after warm-up)")
    p.add_argument(
        "--duration",
        type=positive_float,
        metavar="SECONDS",
        help=f"measured seconds (default {DEFAULT_CLI_DURATION_S:g} without --requests)",
    )
    p.add_argument(
        "--seq-len",
        type=_seq_lens_arg,
        default=parse_seq_lens("16"),
        help="16 (fixed), 8..64 (uniform) or 16,32,128 (a list); default 16",
    )
    p.add_argument(
        "--batch", type=positive_int, default=1, help="sequences per request (default 1)"
    )
    p.add_argument("--weights", action="store_true", help="ask for attention weights too")
    p.add_argument(
        "--channels",
        type=positive_int,
        default=1,
        help="TCP connections the clients share, taken in turn (default 1); a server with "
        "--frontend-workers N spreads connections, not calls, over its frontends: give N or more",
    )
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        default=20,
        help="requests sent first and left out of the stats (default 20)",
    )
    p.add_argument(
        "--max-error-rate",
        type=fraction,
        default=0.0,
        metavar="FRACTION",
        help="exit 1 when more than this fraction of the measured requests failed "
        "(default 0: any failure; 1: never, e.g. when overload refusals are expected)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, metavar="FILE.json", help="write the results here")


def cmd_load(client: Any, args: argparse.Namespace) -> int:
    """Runs the load against args.target with the model's embed_dim; prints the summary.
    Its channels are secured as the CLI's client is (the same --tls, --ca-file, --cert-file,
    --key-file, --token-file and --application)."""
    if args.arrivals is not None and args.rate is None:
        raise UsageError("--arrivals shapes the open loop's arrivals: give --rate with it")
    embed_dim = client.model_info(args.model).embed_dim
    workload = Workload(args.model, args.seq_len, embed_dim, args.batch, args.weights, args.seed)
    duration = args.duration
    if duration is None and args.requests is None:
        duration = DEFAULT_CLI_DURATION_S
    spec = LoadSpec(
        concurrency=None if args.rate is not None else (args.concurrency or 1),
        rate=args.rate,
        arrivals=args.arrivals or "poisson",
        requests=args.requests,
        duration_s=duration,
        warmup=args.warmup,
        timeout_s=args.timeout,
        seed=args.seed,
    )
    target, security, metadata = args.target, client.security, client.metadata
    result = run_load_sync(
        lambda: GrpcTarget(target, channels=args.channels, security=security, metadata=metadata),
        workload,
        spec,
        label=target,
        progress=sys.stderr,
        stop_on_interrupt=True,
    )
    print(result.format())
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if result.interrupted:
        return EXIT_INTERRUPTED
    if result.ok == 0:
        return 1  # nothing answered: not a measurement
    if result.error_rate > args.max_error_rate:
        failed = sum(result.errors.values())
        print(
            f"mha-client load: {failed} of {failed + result.ok} measured requests failed "
            f"({result.error_rate:.1%}), over --max-error-rate {args.max_error_rate:g}",
            file=sys.stderr,
        )
        return 1
    return 0

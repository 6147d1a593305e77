"""`mha-client session ...` and `mha-client decode`: KV-cache sessions from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mha_client.cli_save import SAVE_HELP, save_path, save_result
from mha_client.cli_types import (
    STEP_SHAPES,
    non_negative_int,
    positive_float,
    positive_int,
    read_input,
)
from mha_client.sdk import Client, SessionInfo

EXIT_OK = 0


def add_session_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    session = sub.add_parser(
        "session", parents=[common], help="KV-cache sessions: create, step, fork, truncate, close"
    )
    ops = session.add_subparsers(dest="session_command", required=True, metavar="OP")

    create = ops.add_parser(
        "create", parents=[common], help="a new session on a model; prints its info (id first)"
    )
    create.add_argument("model")
    create.add_argument(
        "--max-len", type=positive_int, help="tokens it may hold (default: the model's)"
    )
    create.add_argument(
        "--ttl",
        type=positive_float,
        help="idle seconds before it expires (default: the server's)",
    )
    create.add_argument("--json", action="store_true")
    create.set_defaults(func=cmd_create)

    for name, helptext, func in (
        ("info", "tokens and bytes a session holds", cmd_info),
        ("fork", "a new session sharing this one's tokens (copy-on-write)", cmd_fork),
        ("close", "free a session's cache now", cmd_close),
    ):
        op = ops.add_parser(name, parents=[common], help=helptext)
        op.add_argument("session_id")
        if name != "close":
            op.add_argument("--json", action="store_true")
        if name == "fork":
            op.add_argument(
                "--ttl",
                type=positive_float,
                help="idle seconds before it expires (default: the parent's)",
            )
        op.set_defaults(func=func)

    truncate = ops.add_parser(
        "truncate", parents=[common], help="keep a session's first N tokens, drop the rest"
    )
    truncate.add_argument("session_id")
    truncate.add_argument(
        "num_tokens", type=non_negative_int, metavar="N", help="tokens kept (0 empties it)"
    )
    truncate.add_argument("--json", action="store_true")
    truncate.set_defaults(func=cmd_truncate)

    step = ops.add_parser(
        "step", parents=[common], help="append tokens; they attend to everything cached"
    )
    step.add_argument("session_id")
    source = step.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", type=Path, metavar="FILE.npy", help="(T, embed_dim) floats")
    source.add_argument("--random-tokens", type=positive_int, metavar="T", help="T random tokens")
    step.add_argument("--seed", type=int, default=0)
    step.add_argument(
        "--weights", action="store_true", help="return the new rows' attention weights"
    )
    step.add_argument("--save", type=save_path, metavar="OUT.npz|OUT.npy", help=SAVE_HELP)
    step.add_argument("--json", action="store_true")
    step.set_defaults(func=cmd_step)

    decode = sub.add_parser(
        "decode", parents=[common], help="demo: a prompt, then token-by-token steps over one stream"
    )
    decode.add_argument("model")
    decode.add_argument(
        "--prompt-len",
        type=positive_int,
        default=128,
        help="tokens prefilled in one step (default 128)",
    )
    decode.add_argument(
        "--steps",
        type=positive_int,
        default=32,
        help="single-token steps over one stream (default 32; the stream's deadline is "
        "--timeout x steps)",
    )
    decode.add_argument("--seed", type=int, default=0)
    decode.add_argument(
        "--keep", action="store_true", help="leave the session open and print its id"
    )
    decode.set_defaults(func=cmd_decode)


def _print_info(info: SessionInfo, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(info), indent=2))
        return
    ttl = f"{info.ttl_s:g} s" if info.ttl_s else "never"
    print(
        f"session    {info.session_id}\nmodel      {info.model}\ntokens     {info.num_tokens}"
        f"{f' of {info.max_len}' if info.max_len else ''}\nblocks     {info.num_blocks}\n"
        f"bytes      {info.bytes_held}\nidle ttl   {ttl}"
    )


def cmd_create(client: Client, args: argparse.Namespace) -> int:
    s = client.create_session(args.model, max_len=args.max_len, ttl_s=args.ttl)
    _print_info(s.info, args.json)
    return EXIT_OK


def cmd_info(client: Client, args: argparse.Namespace) -> int:
    _print_info(client.session(args.session_id).refresh(), args.json)
    return EXIT_OK


def cmd_fork(client: Client, args: argparse.Namespace) -> int:
    _print_info(client.session(args.session_id).fork(ttl_s=args.ttl).info, args.json)
    return EXIT_OK


def cmd_truncate(client: Client, args: argparse.Namespace) -> int:
    _print_info(client.session(args.session_id).truncate(args.num_tokens), args.json)
    return EXIT_OK


def cmd_close(client: Client, args: argparse.Namespace) -> int:
    s = client.session(args.session_id)
    s.refresh()  # NOT_FOUND (with the reason) for a session that is already gone
    s.close()
    print(f"closed {args.session_id}")
    return EXIT_OK


def cmd_step(client: Client, args: argparse.Namespace) -> int:
    s = client.session(args.session_id)
    if args.input is not None:
        x = read_input(args.input, STEP_SHAPES)
    else:
        embed_dim = client.model_info(s.refresh().model).embed_dim
        x = np.random.default_rng(args.seed).standard_normal(
            (args.random_tokens, embed_dim), dtype=np.float32
        )
    r = s.step(x, weights=args.weights)
    if args.save is not None:  # as attend --save: the step's tokens are its one sequence
        save_result(args.save, r, np.asarray([x.shape[-2]], dtype=np.int32))
    summary = {
        "session": asdict(r.session),
        "output_shape": list(r.output.shape),
        "weights_shape": None if r.weights is None else list(r.weights.shape),
        "timing": asdict(r.timing),
        "files": {"saved": str(args.save)} if args.save is not None else {},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        t = r.timing
        print(
            f"appended   {x.shape[-2]} tokens -> session holds {r.session.num_tokens} "
            f"({r.session.bytes_held} bytes)\noutput     {tuple(r.output.shape)}"
        )
        if r.weights is not None:
            print(f"weights    {tuple(r.weights.shape)} (heads, new rows, all keys)")
        print(
            f"timing     queue {t.queue_ms:.2f} ms, compute {t.compute_ms:.2f} ms, "
            f"round trip {t.round_trip_ms:.2f} ms, batch {t.batch_size}"
        )
        if args.save is not None:
            print(f"saved      {args.save}")
    return EXIT_OK


def cmd_decode(client: Client, args: argparse.Namespace) -> int:
    embed_dim = client.model_info(args.model).embed_dim
    rng = np.random.default_rng(args.seed)
    prompt = rng.standard_normal((args.prompt_len, embed_dim), dtype=np.float32)
    tokens = rng.standard_normal((args.steps, 1, embed_dim), dtype=np.float32)
    s = client.create_session(args.model)
    try:
        start = time.perf_counter()
        s.step(prompt)
        prefill_ms = (time.perf_counter() - start) * 1e3
        latencies = []
        # A stream's deadline bounds all of it: --timeout per step.
        with s.stream(timeout=client.timeout * args.steps) as stream:
            for token in tokens:
                t0 = time.perf_counter()
                stream.step(token)
                latencies.append((time.perf_counter() - t0) * 1e3)
        info = s.refresh()
    except BaseException:
        if args.keep:  # the error may not name it: say which session is left open
            print(f"session    {s.id} (left open)", file=sys.stderr)
        raise
    finally:
        if not args.keep:
            s.close()
    lat = np.array(latencies)
    print(
        f"model      {args.model}\nprefill    {args.prompt_len} tokens in {prefill_ms:.1f} ms\n"
        f"decode     {args.steps} steps: {1e3 / lat.mean():.0f} tokens/s, step p50 "
        f"{np.percentile(lat, 50):.2f} ms, p99 {np.percentile(lat, 99):.2f} ms\n"
        f"cache      {info.num_tokens} tokens in {info.num_blocks} blocks, {info.bytes_held} bytes"
    )
    if args.keep:
        print(f"session    {s.id} (left open)")
    return EXIT_OK

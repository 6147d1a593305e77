"""The whole test suite on the suite's device, summed up for docs/benchmarks-gpu.md (make gpu).

    MHA_SERVE_TEST_DEVICE=cuda python bench/gpu_suite.py --json-out FILE [--timeout S] [-- ARGS]

Test modules that cannot be imported because a package is not installed here (an offline GPU
machine lacks some test-only packages) are left out by name, with the package they need;
every other collection error stays an error. At the time limit the run is interrupted
(SIGINT: pytest reports what ran). The summary (counts, failures, what was left out and why)
goes to --json-out; pytest's own output to --log and the terminal.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
INTERRUPT_GRACE_S = 60  # after SIGINT, for pytest's teardown and report; then SIGKILL
# The pytest plugins the suite runs with everywhere (pyproject's dev extra). Only these: a CUDA
# image's own (xdist, cov, benchmark, timeout, ...) would load themselves into the run too,
# and one built for another pytest could break it.
SUITE_PLUGINS = ("pytest_asyncio.plugin", "_hypothesis_pytestplugin")
# pytest's report of a test module or package (its conftest) that could not be imported
COLLECT_ERROR = re.compile(r"^_+ ERROR collecting (?P<path>\S+) _+$", re.M)
NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '(?P<module>[^']+)'")
# pytest's closing line, "3 failed, 120 passed, 4 skipped, 1 error in 301.2s"
CLOSING = re.compile(r"^(?:\S.*)? in [\d.]+s(?: \([\d:]+\))?\W*$", re.M)
OUTCOME = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def missing_modules(collect_output: str) -> dict[str, str]:
    """{test path: the package it lacks} from `pytest --collect-only` output: only modules
    whose top-level package is not installed at all (a missing module of an installed
    package, ours included, is a bug and stays a collection error)."""
    found = {}
    heads = list(COLLECT_ERROR.finditer(collect_output))
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(collect_output)
        block = collect_output[head.end() : end]
        m = NO_MODULE.search(block)
        if m and importlib.util.find_spec(m["module"].split(".")[0]) is None:
            found[head["path"]] = m["module"]
    return found


def closing_counts(output: str) -> dict[str, int] | None:
    """The counts of pytest's closing line (right also when a run was interrupted, where the
    JUnit XML lists the interrupted test without an outcome)."""
    lines = [m[0] for m in CLOSING.finditer(output) if OUTCOME.search(m[0])]
    if not lines:
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for n, what in OUTCOME.findall(lines[-1]):
        key = "errors" if what.startswith("error") else what
        counts[key] = counts.get(key, 0) + int(n)
    return counts


def summarize_junit(path: Path) -> dict[str, Any]:
    """Counts, failures and skip reasons from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                message = (child.get("message") or child.text or "").strip().splitlines()
                failures.append({"test": name, "outcome": child.tag, "message": message[:1]})
            elif child.tag == "skipped":
                outcome = "skipped"
                reason = (child.get("message") or "").strip()
                skips[reason] = skips.get(reason, 0) + 1
        counts[outcome] += 1
    top = sorted(skips.items(), key=lambda kv: -kv[1])[:10]
    return {"counts": counts, "failures": failures, "skip_reasons": top}


def pytest_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a pytest run with exactly SUITE_PLUGINS (those here)."""
    plugins = [p for p in SUITE_PLUGINS if importlib.util.find_spec(p) is not None]
    cmd = [sys.executable, "-m", "pytest", *(f"-p{p}" for p in plugins), *args]
    return cmd, {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def run_pytest(args: list[str], log, timeout_s: float) -> tuple[int, bool, str]:
    """pytest with args, its output to the terminal and log (and returned); SIGINT at the
    time limit."""
    cmd, env = pytest_command(args)
    log.write(f"$ {' '.join(cmd)}\n".encode())
    # (SIGINT back to its default in the child: a shell's background job inherits it ignored,
    # and a Python started so never raises KeyboardInterrupt, so the limit could only kill)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    timed_out = False
    output = bytearray()
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        chunk = proc.stdout.read()
        if chunk:
            output += chunk
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            log.write(chunk)
        if proc.poll() is not None and not chunk:
            break
        if deadline is not None and time.monotonic() > deadline and not timed_out:
            timed_out = True
            print(f"\ngpu_suite: {timeout_s:.0f} s limit reached: interrupting", flush=True)
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + INTERRUPT_GRACE_S
        elif timed_out and time.monotonic() > deadline:
            proc.kill()
        time.sleep(0.05)
    return proc.returncode, timed_out, output.decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json-out", type=Path, required=True)
    p.add_argument("--log", type=Path, help="pytest's output (default: beside --json-out)")
    p.add_argument(
        "--timeout", type=float, default=0, help="seconds for collection and run; 0: no limit"
    )
    p.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = p.parse_args(argv)
    log_path = args.log or args.json_out.with_suffix(".log")
    junit = args.json_out.with_suffix(".xml")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cmd, env = pytest_command(["--collect-only", "-q", *args.pytest_args])
    collect = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    left_out = missing_modules(collect.stdout)
    for path, module in left_out.items():
        print(f"gpu_suite: leaving out {path}: needs {module!r}, not installed here", flush=True)
    junit.unlink(missing_ok=True)  # (a killed run writes none: never sum up an older run's)
    run_args = ["-q", "-rfEs", f"--junitxml={junit}", *args.pytest_args]
    run_args += [f"--ignore={path}" for path in left_out]
    limit = 0.0  # what the collection left of the time limit, at least a little
    if args.timeout > 0:
        limit = max(5.0, args.timeout - (time.monotonic() - started))
    with open(log_path, "wb") as log:
        code, timed_out, output = run_pytest(run_args, log, limit)
    summary: dict[str, Any] = {
        "command": " ".join(["pytest", *pytest_command(run_args)[0][3:]]),
        "device": os.environ.get("MHA_SERVE_TEST_DEVICE", "cpu"),
        "exit_code": code,
        "timed_out": timed_out,
        "timeout_s": args.timeout,
        "duration_s": time.monotonic() - started,
        "left_out": [{"path": k, "needs": v} for k, v in left_out.items()],
    }
    if junit.exists():
        summary |= summarize_junit(junit)
    counts = closing_counts(output)
    if counts is not None:
        summary["counts"] = counts
    args.json_out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"gpu_suite: exit {code}{' (time limit)' if timed_out else ''}; {args.json_out}")
    return code


if __name__ == "__main__":
    sys.exit(main())

"""THE benchmark command: in-process limit, naive server, Ray Serve and mha-serve side by side.

    python bench/run_all.py [--quick] [--no-profile]

Writes docs/benchmarks.md, docs/images/bench_throughput.png, docs/images/bench_latency.png
and bench/results/latest.json. Every server listens on 127.0.0.1 and runs alone while it is
measured; the load generator (mha_client.loadgen) runs in this process, on the same cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mha_client.loadgen import GrpcTarget, LoadSpec, Workload, parse_seq_lens, run_load_sync
from mha_client.sdk import Client

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))  # the sibling scripts below are modules too
import ray_baseline  # noqa: E402
import report  # noqa: E402

MODEL = "mha"  # the built-in model: embed_dim 512, 8 heads
EMBED_DIM = 512
SEQ_LENS = (16, 128)
HEADLINE_CONCURRENCY = 32  # where the targets are read
START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60
MAX_REQUESTS_PER_POINT = 1_000_000  # a second bound besides the duration
# "echo" (the naive server answering with its input, no compute) is measured at the headline
# concurrency only: the cost of the wire itself, a ceiling for every gRPC server here.
SYSTEMS = ("naive", "echo", "ray", "mha-serve")
PROFILE_RATE_HZ = 100


@dataclass(frozen=True)
class Settings:
    sweep: tuple[int, ...]  # concurrencies; HEADLINE_CONCURRENCY must be one of them
    duration_s: float  # measured seconds per point
    headline_duration_s: float  # ... at HEADLINE_CONCURRENCY
    inprocess_batches: tuple[int, ...]
    inprocess_min_time_s: float
    wire_min_time_s: float

    def warmup(self, concurrency: int) -> int:
        return 2 * concurrency + 10


FULL = Settings((1, 4, 16, 32, 64), 8.0, 15.0, (1, 4, 16, 32, 64, 128, 256), 1.0, 0.5)
QUICK = Settings((1, 32), 2.0, 3.0, (1, 32, 128), 0.2, 0.1)


# ----- CPU accounting from /proc: who used the cores during a measurement

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list[str]:
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()  # fields after "pid (comm)"


def _cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def process_tree(root: int) -> dict[int, float]:
    """root and its live descendants (Ray's actors included): pid -> CPU seconds so far."""
    parents, cpu = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = _stat_fields(f"/proc/{entry}/stat")
        except (OSError, IndexError):
            continue
        parents[int(entry)], cpu[int(entry)] = int(fields[1]), _cpu_s(fields)
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, parent in parents.items() if parent == pid and p not in tree]
        tree.update(children)
        frontier.extend(children)
    return {p: cpu.get(p, 0.0) for p in tree}


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by root and its live descendants (Ray's actors included)."""
    return sum(process_tree(root).values())


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of pid, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = _cpu_s(_stat_fields(f"/proc/{pid}/task/{tid}/stat"))
        except (OSError, IndexError):
            continue
    return out


def machine_cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, all cores (/proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9]
        )
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


def snapshot(server_pid: int) -> tuple[float, ...]:
    busy, steal = machine_cpu_s()
    own = _cpu_s(_stat_fields(f"/proc/{os.getpid()}/stat"))
    return time.monotonic(), busy, steal, tree_cpu_s(server_pid), own


# ----- the servers under test, each a subprocess in its own session


class Server:
    """A benchmark server subprocess; its log goes to a file, its address is read from it."""

    def __init__(self, name: str, cmd: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.started = time.monotonic()

    def wait_line(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if match := re.search(pattern, self.log_path.read_text(errors="replace")):
                return match
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} did not start; its log:\n{self.log_path.read_text()}")

    def stop(self) -> float:
        """SIGTERM, then SIGKILL to its whole session after STOP_TIMEOUT_S; seconds it took."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()
        return time.monotonic() - start


def start_system(name: str, log_dir: Path) -> tuple[Server, Any]:
    """Starts one system; returns it and a factory of load-generator targets for it."""
    py = sys.executable
    if name in ("naive", "echo"):
        flags = ["--echo"] if name == "echo" else []
        server = Server(name, [py, str(BENCH / "naive_server.py"), "--port", "0", *flags], log_dir)
        address = server.wait_line(r"listening on (\S+)").group(1)
        return server, lambda: GrpcTarget(address)
    if name == "ray":
        server = Server(name, [py, str(BENCH / "ray_baseline.py"), "--port", "0"], log_dir)
        url = server.wait_line(r"listening on (http://\S+)").group(1)
        return server, lambda: ray_baseline.HttpTarget(url)
    port = ray_baseline.free_port()
    address = f"127.0.0.1:{port}"
    cmd = [py, "-m", "mha_serve.transport.main", "--host", "127.0.0.1", "--port", str(port)]
    server = Server(name, [*cmd, "--metrics-port", "0"], log_dir)
    with Client(address) as client:
        try:
            client.wait_ready(START_TIMEOUT_S)
        except Exception as err:
            server.stop()
            log = server.log_path.read_text()
            raise RuntimeError(f"mha-serve did not start ({err}); its log:\n{log}") from None
    return server, lambda: GrpcTarget(address)


def measure_point(
    system: str,
    server: Server,
    factory: Any,
    seq_len: int,
    concurrency: int,
    duration_s: float,
    warmup: int,
) -> dict[str, Any]:
    workload = Workload(MODEL, parse_seq_lens(str(seq_len)), EMBED_DIM)
    spec = LoadSpec(
        concurrency=concurrency,
        duration_s=duration_s,
        warmup=warmup,
        requests=MAX_REQUESTS_PER_POINT,
    )
    before = snapshot(server.proc.pid)
    result = run_load_sync(factory, workload, spec, label=f"{system} L={seq_len} c={concurrency}")
    wall, busy, steal, srv, cli = (
        a - b for a, b in zip(snapshot(server.proc.pid), before, strict=True)
    )
    point = result.to_dict()
    point.update(system=system, seq_len=seq_len)
    cpu = point["cpu_cores"] = {
        "server": srv / wall,
        "client": cli / wall,
        "other": max(0.0, busy - srv - cli) / wall,  # other processes on the machine
        "steal": steal / wall,  # taken by the hypervisor: this VM did not get it
    }
    lat = result.latency
    print(
        f"  {system:9s} L={seq_len:3d} c={concurrency:2d}: {result.sequences_per_s:8.1f} seq/s  "
        f"p50 {lat.p50_ms:7.1f}  p99 {lat.p99_ms:7.1f} ms  errors {sum(result.errors.values())}  "
        f"cores: server {cpu['server']:.2f} client {cpu['client']:.2f} "
        f"other {cpu['other']:.2f} steal {cpu['steal']:.2f}",
        flush=True,
    )
    return point


def profile_mha_serve(server: Server, factory: Any, settings: Settings, out: Path) -> dict:
    """py-spy samples of mha-serve under the 16-token, 32-client load (an extra run, not one
    of the measured points: sampling slows the server a little)."""
    spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    duration = max(5, int(settings.headline_duration_s))
    raw = out / "profile_mha_serve_16.txt"
    cmd = [
        spy_bin,
        "record",
        "--pid",
        str(server.proc.pid),
        "--duration",
        str(duration),
        "--rate",
        str(PROFILE_RATE_HZ),
        "--format",
        "raw",
        "--threads",
        "--nonblocking",
        "-o",
        str(raw),
    ]
    try:
        spy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as err:
        return {"error": f"py-spy did not run ({err}); pip install py-spy"}
    threads_before = thread_cpu_s(server.proc.pid)
    t0 = time.monotonic()
    point = measure_point(
        "mha-serve",
        server,
        factory,
        16,
        HEADLINE_CONCURRENCY,
        duration + 2,
        settings.warmup(HEADLINE_CONCURRENCY),
    )
    wall = time.monotonic() - t0
    threads_after = thread_cpu_s(server.proc.pid)
    spy_output = spy.communicate(timeout=60)[0]
    if spy.returncode != 0 or not raw.exists():
        return {"error": f"py-spy failed: {spy_output.strip()[-500:]}"}
    thread_cores = {
        tid: (cpu - threads_before.get(tid, 0.0)) / wall for tid, cpu in threads_after.items()
    }
    summary = report.summarize_profile(raw, duration, PROFILE_RATE_HZ, thread_cores)
    summary["sequences_per_s"] = point["sequences_per_s"]
    return summary


def run(settings: Settings, profile: bool, command: str) -> dict[str, Any]:
    started = time.monotonic()
    results: dict[str, Any] = {
        "command": command,
        "machine": report.machine_info(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": asdict(settings),
        "headline_concurrency": HEADLINE_CONCURRENCY,
        "load": [],
        "startup_s": {},
    }
    out = BENCH / "results"
    out.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mha-bench-") as tmp:
        tmp_dir = Path(tmp)
        print("wire codec ...", flush=True)
        wire_args = ["--min-time", str(settings.wire_min_time_s)]
        results["wire"] = _subprocess_json("wire.py", wire_args, tmp_dir)
        print("in-process limit ...", flush=True)
        args = [
            "--seq-len",
            *map(str, SEQ_LENS),
            "--min-time",
            str(settings.inprocess_min_time_s),
            "--batch-sizes",
            ",".join(map(str, settings.inprocess_batches)),
        ]
        results["inprocess"] = _subprocess_json("inprocess.py", args, tmp_dir)
        for system in SYSTEMS:
            print(f"{system}: starting", flush=True)
            server, factory = start_system(system, tmp_dir)
            results["startup_s"][system] = time.monotonic() - server.started
            sweep = (HEADLINE_CONCURRENCY,) if system == "echo" else settings.sweep
            try:
                for seq_len in SEQ_LENS:
                    for c in sweep:
                        headline = c == HEADLINE_CONCURRENCY
                        d = settings.headline_duration_s if headline else settings.duration_s
                        point = measure_point(
                            system, server, factory, seq_len, c, d, settings.warmup(c)
                        )
                        results["load"].append(point)
                if system == "mha-serve" and profile:
                    print("mha-serve: py-spy profile under the 16-token load", flush=True)
                    results["profile"] = profile_mha_serve(server, factory, settings, out)
            finally:
                print(f"{system}: stopped in {server.stop():.1f} s", flush=True)
    results["elapsed_s"] = time.monotonic() - started
    results["targets"] = report.targets(results, HEADLINE_CONCURRENCY)
    return results


def _subprocess_json(script: str, args: list[str], tmp_dir: Path) -> dict[str, Any]:
    """Runs a bench script in its own process (torch stays out of the load generator); adds
    the cores it, other processes and steal used meanwhile."""
    path = tmp_dir / f"{script}.json"
    cmd = [sys.executable, str(BENCH / script), *args, "--json-out", str(path)]
    (busy0, steal0), child0, t0 = machine_cpu_s(), _children_cpu_s(), time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    (busy1, steal1), child1, wall = machine_cpu_s(), _children_cpu_s(), time.monotonic() - t0
    result = json.loads(path.read_text())
    own = child1 - child0
    result["cpu_cores"] = {
        "server": own / wall,
        "client": 0.0,
        "other": max(0.0, busy1 - busy0 - own) / wall,
        "steal": (steal1 - steal0) / wall,
    }
    return result


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke test: < 3 minutes, noisy figures")
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the py-spy profile of mha-serve (never taken with --quick)",
    )
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="where the table and plots go")
    p.add_argument(
        "--from-json",
        type=Path,
        metavar="RESULTS.json",
        help="measure nothing: rewrite the docs from an earlier run's results",
    )
    args = p.parse_args(argv)
    if args.from_json is not None:
        report.write_docs(json.loads(args.from_json.read_text()), args.docs)
        print(f"wrote {args.docs / 'benchmarks.md'} and plots from {args.from_json}")
        return 0
    command = (
        "python bench/run_all.py" + " --quick" * args.quick + " --no-profile" * args.no_profile
    )
    settings = QUICK if args.quick else FULL
    results = run(settings, profile=not (args.quick or args.no_profile), command=command)
    (BENCH / "results" / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    report.write_docs(results, args.docs)
    print()
    print(report.summary_text(results))
    print(
        f"\nwrote {args.docs / 'benchmarks.md'}, plots in {args.docs / 'images'}, raw results "
        f"in bench/results/latest.json ({results['elapsed_s'] / 60:.1f} min)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

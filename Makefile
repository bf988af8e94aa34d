# `make test` and `make demo` each set up .venv on a fresh machine by themselves.
# torch is installed first and only if missing: the CPU build on machines without an NVIDIA
# GPU (never the multi-GB CUDA wheels), the default build where `nvidia-smi` works.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Where the CPU build comes from if no local wheel or mirror provides `torch==X+cpu`.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

export WANDB_MODE ?= offline
export WANDB_SILENT ?= true
export MLFLOW_DISABLE_TELEMETRY ?= true
export MPLBACKEND ?= Agg
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: setup test lint format demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	elif [ "$$(uname -s)" = "Darwin" ]; then \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	else \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null \
		|| $(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" --extra-index-url $(TORCH_CPU_INDEX); \
	fi
	$(PY) -m pip install -q -e ".[dev,verl]"
	touch $@

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: setup lint
	$(VENV)/bin/pytest -q

# For now: one toy OM-GRPO run (no CAR: it costs ~4x generation on the toy world) on the CPU.
demo: setup
	$(VENV)/bin/omgrpo train method=om_grpo_no_car run.root=runs run.name=demo__om_grpo__s0 trainer.steps=20
	@echo "results: runs/demo__om_grpo__s0/ (metrics.jsonl, rollouts/, checkpoints/, config.yaml)"

clean:
	rm -rf $(VENV) runs .cache .pytest_cache .ruff_cache

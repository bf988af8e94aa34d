# `make test` and `make demo` each set up .venv on a fresh machine by themselves.
# torch is installed first and only if missing: the CPU build on machines without an NVIDIA
# GPU (never the multi-GB CUDA wheels), the default build where `nvidia-smi` works.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Installs go through uv (pinned in the lock, bootstrapped with pip): the same packages as pip
# resolves from the lock (pip freeze identical), in 43 s instead of 678 s on a loaded 2-core
# machine. torch alone goes through pip, which finds the CPU build on local disk where uv would
# not look. If uv cannot reach the registry, pip does the same install.
# Nothing is compiled to bytecode at install: Python compiles a module the first time it is
# imported and keeps the .pyc. Compiling all 24,600 files of the environment made a fresh
# machine's setup 120-170 s instead of 45-50 s (uv's and pip's install steps alone, measured
# side by side), and the whole suite imports about a quarter of them. So that each module is
# compiled once, not once per process (the suite starts about 60), make's own commands write
# bytecode even where the caller's environment sets PYTHONDONTWRITEBYTECODE.
INSTALL = install() { $(VENV)/bin/uv pip install -q --python $(PY) "$$@" \
  || $(PY) -m pip install -q --no-compile "$$@"; }; install
PIP_INSTALL := $(PY) -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE
# The locked environment: `make lock` resolves pyproject.toml (dependencies and the dev, verl and
# notebooks extras) with constraints/lock.in into constraints/lock.txt, every package pinned, for
# Python 3.10-3.12 on every platform; every install below is constrained by it, so a fresh clone
# installs what CI tested. LOCK_DATE is the resolver's cut-off (uv's --exclude-newer).
LOCK := constraints/lock.txt
LOCK_IN := constraints/lock.in
LOCK_EXTRAS := dev verl notebooks
LOCK_DATE ?= $(shell date -u +%Y-%m-%d)
TORCH_VERSION ?= $(shell sed -n 's/^torch==\([0-9.]*\).*/\1/p' $(LOCK_IN))
# Where the CPU build comes from if no local wheel or mirror provides `torch==X+cpu`.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

export WANDB_MODE ?= offline
export WANDB_SILENT ?= true
export MLFLOW_DISABLE_TELEMETRY ?= true
export MPLBACKEND ?= Agg
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: setup setup-gpu lock test test-fast durations lint format demo study study-v2 study-v3 study-v4 calibration clean bench-env

# setup: everything `make test` needs (dev tools, the verl extra); the demo needs only the
# package itself, so `make demo` on a fresh machine skips the dev and verl installs.
setup: $(VENV)/.installed

$(VENV)/.installed: $(VENV)/.installed-base
	$(INSTALL) -e ".[dev,verl]" -c $(LOCK)
	touch $@

$(VENV)/.installed-base: pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PIP_INSTALL) "torch==$(TORCH_VERSION)"; \
	elif [ "$$(uname -s)" = "Darwin" ]; then \
		$(PIP_INSTALL) "torch==$(TORCH_VERSION)"; \
	else \
		$(PIP_INSTALL) "torch==$(TORCH_VERSION)+cpu" 2>/dev/null \
		|| $(PIP_INSTALL) "torch==$(TORCH_VERSION)+cpu" --extra-index-url $(TORCH_CPU_INDEX); \
	fi
	$(PIP_INSTALL) "$$(grep '^uv==' $(LOCK))"
	$(INSTALL) -e . -c $(LOCK)
	touch $@

# lock: re-resolve constraints/lock.txt (needs the package registry). To upgrade a dependency,
# raise its range in pyproject.toml (or torch in constraints/lock.in), run `make lock`, then
# `make test`, and commit pyproject.toml and both constraints files together.
lock:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$$(grep '^uv==' $(LOCK) || echo uv)"
	$(VENV)/bin/uv pip compile pyproject.toml $(LOCK_IN) $(foreach e,$(LOCK_EXTRAS),--extra $(e)) \
	  --universal --python-version 3.10 --exclude-newer $(LOCK_DATE) --no-header -q -o $(LOCK).new
	{ echo "# omgrpo's locked environment, written by \`make lock\` (uv pip compile pyproject.toml"; \
	  echo "# $(LOCK_IN), extras $(LOCK_EXTRAS), --universal --python-version 3.10 --exclude-newer $(LOCK_DATE))."; \
	  echo "# Every install in the Makefile is constrained by it (pip -c); do not edit by hand."; \
	  cat $(LOCK).new; } > $(LOCK)
	rm -f $(LOCK).new

# setup-gpu: .venv on a GPU machine with the set verl 0.9.1 declares as tested (its `verl[vllm]`
# extra: torch 2.11.0, vLLM 0.24.0, transformers 5.9.0; PyPI's torch 2.11.0 is a CUDA 13 build),
# pinned in constraints/gpu.txt; tests/test_install.py checks that a resolver accepts it. The
# stamps let `make test` run on it as it is.
setup-gpu:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e ".[dev,gpu]" -c constraints/gpu.txt
	touch $(VENV)/.installed-base $(VENV)/.installed

# `omgrpo bench step --vs-trl` needs TRL (the `bench` extra), which cannot share .venv with verl
# 0.9.1: its own environment, with the same torch build as .venv so both sides of the ratio run
# on the torch `make test` installs (PyPI's default CUDA build ran omgrpo's toy step 10-13 %
# slower on the CPU, TRL's within 8 %).
TRL_VENV ?= .venv-trl

bench-env:
	$(MAKE) VENV=$(TRL_VENV) $(TRL_VENV)/.installed-base
	$(TRL_VENV)/bin/python -m pip install -q -e ".[bench]" -c $(LOCK)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The suite on TEST_WORKERS processes (pytest-xdist): on 2 cores 2 workers took 8 min where one
# took 16-17 (the longest tests retrain a base and run verl end to end, a minute or two each).
# TEST_WORKERS=0 runs it in one process. Tiers (markers in pyproject.toml): `make test` is the
# whole suite, what CI runs; `make test-fast` leaves out the `slow` tests (training, whole verbs)
# and the `e2e` ones (verl workers, servers, subprocesses, wheel builds, notebooks).
# `--dist loadfile` hands each test file to one worker, in collection order, so a module fixture
# runs once (test_verl_e2e.py's two verl runs, ~2 min each; test_sweep.py's composed plans).
# Not `--dist loadgroup`: with pytest 9, xdist 3.8's `xdist_group` marks are lost (it renames
# items through `_nodeid`, which pytest no longer reads) and a group's tests are split.
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup lint
	$(VENV)/bin/pytest -q $(XDIST) $(PYTEST_ARGS)

test-fast: setup lint
	$(VENV)/bin/pytest -q $(XDIST) -m "not slow and not e2e" $(PYTEST_ARGS)

# durations: rerun the whole suite and rewrite tests/durations.txt, every test's time (slowest
# first), the snapshot that tells which tests to mark `slow` or `e2e` and by which the suite starts
# its longest files first (tests/conftest.py).
durations: setup
	{ echo "# make durations: $$(date -u +%F), commit $$(git rev-parse --short HEAD), $$(nproc) cores, $(TEST_WORKERS) workers"; \
	  $(VENV)/bin/pytest -q $(XDIST) --durations=0 --durations-min=0.5 -p no:cacheprovider \
	  | sed -En '/slowest durations/,/short test summary|^[0-9]+ (passed|failed)/p'; } > tests/durations.txt

# Three arms of the collapse studies' central comparison (v2's settings, which v3 kept but for
# 16 validation samples) in the shortcut world (sweeps/collapse_demo.yaml): the shuffled-advantage null, majority voting and OM-GRPO (w = 0, the paper's span), 150 steps
# each with the study's calibrated settings from the shipped shortcut base, 3 runs at once on one
# thread each, then the report (what happened, in words), summary.json and the figures. More
# seeds: make demo DEMO_SEEDS="0 1 2". Finished runs are skipped when run again.
DEMO_SEEDS ?= 0
DEMO_RUNS ?= runs/collapse-demo
DEMO_REPORT ?= reports/collapse-demo

demo: $(VENV)/.installed-base
	@for seed in $(DEMO_SEEDS); do \
		$(VENV)/bin/omgrpo sweep sweeps/collapse_demo.yaml --jobs 3 seed=$$seed run.root=$(DEMO_RUNS) trainer.threads=1 || exit 1; \
	done
	$(VENV)/bin/omgrpo report $(DEMO_RUNS) --out $(DEMO_REPORT) --title "Collapse demo (shortcut world)"
	@echo "report: $(DEMO_REPORT)/report.md  summary: $(DEMO_REPORT)/summary.json"

# The pre-registered collapse study (reports/collapse-study/PREREGISTRATION.md): resumable,
# 2 runs at a time; finished runs are skipped when run again. STUDY_SEEDS and STUDY_PARTS
# restrict it, e.g. one seed of the central comparison:
#   make study STUDY_SEEDS=0 STUDY_PARTS=central
STUDY_SEEDS ?= 0 1 2
STUDY_PARTS ?= central base1 secondary worlds
STUDY_RUNS ?= runs/collapse-study
STUDY_REPORT ?= reports/collapse-study
OMGRPO := $(VENV)/bin/omgrpo

study: $(VENV)/.installed-base
	@start=$$(date +%s); \
	for part in $(STUDY_PARTS); do case $$part in \
	  central) for seed in $(STUDY_SEEDS); do \
	    $(OMGRPO) sweep sweeps/collapse_study_central.yaml --jobs 2 seed=$$seed run.root=$(STUDY_RUNS) || exit 1; done;; \
	  base1) $(OMGRPO) sweep sweeps/collapse_study_central.yaml --jobs 2 seed=0 model.warm_start.seed=1 \
	    run.experiment=toy_shortcut_base1 run.root=$(STUDY_RUNS) || exit 1;; \
	  secondary|worlds) $(OMGRPO) sweep sweeps/collapse_study_$$part.yaml --jobs 2 run.root=$(STUDY_RUNS) || exit 1;; \
	  *) echo "unknown STUDY_PARTS entry '$$part' (central base1 secondary worlds)"; exit 2;; \
	esac; done; \
	$(OMGRPO) study-report $(STUDY_RUNS) --prereg $(STUDY_REPORT)/PREREGISTRATION.md --out $(STUDY_REPORT) \
	  --command "make study STUDY_SEEDS='$(STUDY_SEEDS)' STUDY_PARTS='$(STUDY_PARTS)'" --seconds $$(( $$(date +%s) - start ))

# The v2 study's calibration (reports/collapse-study-v2/CALIBRATION-PREREGISTRATION.md): the
# two controls (GT, shuffled-advantage null) per candidate setting and seed, 2 runs at a time
# on one thread each, resumable (finished runs are skipped, killed ones continue from their
# newest checkpoint). After each pair, the finished runs' compact results (metrics.jsonl, xz-
# compressed by `omgrpo compact`; config.yaml, status.json, provenance.json; no checkpoints) are
# copied to CALIB_COPY.
CALIB_SEEDS ?= 0 1 2
CALIB_CANDIDATES ?= calib_v2_a calib_v2_b calib_v2_c
CALIB_RUNS ?= runs/collapse-calibration
CALIB_COPY ?= reports/collapse-study-v2/calibration/runs

calibration: $(VENV)/.installed-base
	@for seed in $(CALIB_SEEDS); do for cand in $(CALIB_CANDIDATES); do \
	  $(OMGRPO) sweep sweeps/collapse_calibration.yaml --jobs 2 seed=$$seed +study=$$cand \
	    run.experiment=$$cand run.root=$(CALIB_RUNS) trainer.threads=1; \
	  for d in $(CALIB_RUNS)/calib_v2_*__*; do \
	    [ -d "$$d" ] && grep -q '"finished"' "$$d/status.json" 2>/dev/null || continue; \
	    mkdir -p $(CALIB_COPY)/$$(basename $$d); \
	    cp $$d/metrics.jsonl* $$d/config.yaml $$d/status.json $$d/provenance.json $(CALIB_COPY)/$$(basename $$d)/; \
	  done; $(OMGRPO) compact $(CALIB_COPY); done; done

# The collapse study v2 (reports/collapse-study-v2/PREREGISTRATION-v2.md): resumable across
# machines. The finished runs' compact results committed under STUDY2_COPY are copied into
# STUDY2_RUNS first (so the sweeps skip them); killed runs continue from their newest checkpoint;
# after each sweep the finished runs' compact results (metrics.jsonl, xz-compressed by `omgrpo
# compact`; config.yaml, status.json, provenance.json, identity.json; no checkpoints or
# rollouts) are copied to STUDY2_COPY. Central:
# per seed, both bases (the shipped one, and warm-start seed 1 as toy_shortcut_base1);
# secondary and worlds: seeds 3 and 4. 2 runs at a time on one thread each, e.g.
#   make study-v2 STUDY2_SEEDS="3 4" STUDY2_PARTS=central
STUDY2_SEEDS ?= 3 4 5 6
STUDY2_SECONDARY_SEEDS ?= 3 4
STUDY2_PARTS ?= central secondary worlds
STUDY2_RUNS ?= runs/collapse-study-v2
STUDY2_REPORT ?= reports/collapse-study-v2
STUDY2_COPY ?= $(STUDY2_REPORT)/runs
STUDY2_SWEEPS ?= sweeps/collapse_study_v2
STUDY2_PREREG ?= $(STUDY2_REPORT)/PREREGISTRATION-v2.md
STUDY2_TARGET ?= study-v2
STUDY2_EXPECT ?=
STUDY2_ARGS = --jobs 2 run.root=$(STUDY2_RUNS) trainer.threads=1

study-v2: $(VENV)/.installed-base
	@start=$$(date +%s); mkdir -p $(STUDY2_RUNS) $(STUDY2_COPY); cp -Rn $(STUDY2_COPY)/. $(STUDY2_RUNS)/; \
	copy() { for d in $(STUDY2_RUNS)/*__*__s*; do \
	  grep -qs '"finished"' "$$d/status.json" || continue; mkdir -p $(STUDY2_COPY)/$$(basename $$d); \
	  cp $$d/metrics.jsonl* $$d/config.yaml $$d/status.json $$d/provenance.json $$d/identity.json \
	    $(STUDY2_COPY)/$$(basename $$d)/; done; $(OMGRPO) compact $(STUDY2_COPY); }; \
	for part in $(STUDY2_PARTS); do case $$part in \
	  central) for seed in $(STUDY2_SEEDS); do \
	    $(OMGRPO) sweep $(STUDY2_SWEEPS)_central.yaml $(STUDY2_ARGS) seed=$$seed || exit 1; copy; \
	    $(OMGRPO) sweep $(STUDY2_SWEEPS)_central.yaml $(STUDY2_ARGS) seed=$$seed model.warm_start.seed=1 \
	      run.experiment=toy_shortcut_base1 || exit 1; copy; done;; \
	  secondary|worlds) for seed in $(STUDY2_SECONDARY_SEEDS); do \
	    $(OMGRPO) sweep $(STUDY2_SWEEPS)_$$part.yaml $(STUDY2_ARGS) seed=$$seed || exit 1; copy; done;; \
	  *) echo "unknown STUDY2_PARTS entry '$$part' (central secondary worlds)"; exit 2;; \
	esac; done; \
	done_runs=$$(ls -d $(STUDY2_COPY)/*__*__s* 2>/dev/null | wc -l); \
	if [ -n "$(STUDY2_EXPECT)" ] && [ $$done_runs -lt $(STUDY2_EXPECT) ]; then \
	  echo "$$done_runs of $(STUDY2_EXPECT) runs finished in $(STUDY2_COPY): no report until all are in"; exit 0; fi; \
	$(OMGRPO) study-report $(STUDY2_RUNS) --prereg $(STUDY2_PREREG) --out $(STUDY2_REPORT) \
	  --command "make $(STUDY2_TARGET) STUDY2_SEEDS='$(STUDY2_SEEDS)' STUDY2_PARTS='$(STUDY2_PARTS)'" --seconds $$(( $$(date +%s) - start ))

# The collapse study v3 (reports/collapse-study-v3/PREREGISTRATION-v3.md): v2's central grid on
# 12 fresh units (seeds 7-12 x both bases) with 16 validation samples per problem; the same
# recipe, resumable the same way from reports/collapse-study-v3/runs.
study-v3:
	$(MAKE) study-v2 STUDY2_TARGET=study-v3 STUDY2_SWEEPS=sweeps/collapse_study_v3 \
	  STUDY2_SEEDS="7 8 9 10 11 12" STUDY2_PARTS=central STUDY2_RUNS=runs/collapse-study-v3 \
	  STUDY2_REPORT=reports/collapse-study-v3 STUDY2_PREREG=reports/collapse-study-v3/PREREGISTRATION-v3.md

# The collapse study v4 (reports/collapse-study-v4/PREREGISTRATION-v4.md): v3's central grid over
# 450 steps on 6 fresh units (seeds 13-15 x both bases) and the three generic-mask arms on seeds
# 13-15 of the shipped base; the same recipe, resumable from reports/collapse-study-v4/runs. The
# report is written only once all 45 runs are in (before that it prints the count), e.g.
#   make study-v4 STUDY4_PARTS=central
STUDY4_PARTS ?= central secondary
study-v4:
	$(MAKE) study-v2 STUDY2_TARGET=study-v4 STUDY2_SWEEPS=sweeps/collapse_study_v4 \
	  STUDY2_SEEDS="13 14 15" STUDY2_SECONDARY_SEEDS="13 14 15" STUDY2_PARTS="$(STUDY4_PARTS)" \
	  STUDY2_RUNS=runs/collapse-study-v4 STUDY2_REPORT=reports/collapse-study-v4 STUDY2_EXPECT=45 \
	  STUDY2_PREREG=reports/collapse-study-v4/PREREGISTRATION-v4.md

clean:
	rm -rf $(VENV) runs .cache .pytest_cache .ruff_cache

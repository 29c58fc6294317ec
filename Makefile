# make test: set up a virtual environment with uv and run the whole suite.
# make demo: set up the same environment and run the main job.
VENV      ?= .venv
PY        := $(VENV)/bin/python
# uv from PATH; where there is none, one installed into .uv-tools (a virtual
# environment of its own: pip refuses to install into a system python, PEP 668).
UV        ?= $(or $(shell command -v uv 2>/dev/null),.uv-tools/bin/uv)
UV_DEP    := $(filter .uv-tools/bin/uv,$(UV))
# Local wheel folders (PIP_FIND_LINKS) carry the CPU build of torch; uv does not read that variable.
LINKDIRS  := $(or $(PIP_FIND_LINKS),$(wildcard /opt/wheels))
FINDLINKS := $(foreach d,$(LINKDIRS),--find-links $(d))
# Bytecode compiled once at install: where PYTHONDONTWRITEBYTECODE is set (CI
# images often set it), every Ray worker and spawned rank would otherwise
# compile torch's and Ray's sources again at import (4-5 s of CPU each).
UVINSTALL := $(UV) pip install --quiet --compile-bytecode $(FINDLINKS) -c constraints.txt
PYTEST_ARGS ?=
# Test processes (pytest-xdist): each runs whole test files, with its own Ray cluster
# and S3 server. Much of a test's time is spent waiting on other processes (ranks,
# actors, a job's start, Prometheus's rule evaluations): on 2 cores, two workers
# left them idle part of the time, three keep them 94% busy (the suite: 12.5 min
# with two, 11.2 with three). TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= 3
PYTEST    := -m pytest -n $(TEST_WORKERS) --dist loadfile
# The project's own sources are installed editable, which --compile-bytecode does not
# reach: compiled before each run (only what changed), for the same reason (0.6 s of
# CPU in every process that imports obsckpt, hundreds of processes per run).
COMPILE   := -m compileall -q -j 0 obsckpt tests benchmarks dashboards

.PHONY: setup test test-verl-min test-trinity test-verl-upstream demo lint metrics-doc dashboards bench bench-quick bench-check gpu-check clean

setup: $(VENV)/.installed

.uv-tools/bin/uv:
	@python3 -m venv .uv-tools || { echo "make: cannot create .uv-tools; install uv (https://docs.astral.sh/uv/) or python3-venv" >&2; exit 1; }
	.uv-tools/bin/python -m pip install --quiet uv

$(VENV)/.installed: pyproject.toml constraints.txt Makefile | $(UV_DEP)
	$(UV) venv --quiet --allow-existing --python python3 $(VENV)
	$(UVINSTALL) --python $(PY) -e ".[all]"
	@touch $@

test: setup
	$(PY) $(COMPILE)
	$(PY) $(PYTEST) $(PYTEST_ARGS)

# The verl integrations against the lowest verl the verl extra allows (what
# Trinity-RFT pins). verl 0.7.1 requires numpy<2, and pyarrow 21+ requires NumPy 2.
VERL_MIN_VENV ?= .venv-verl-min
VERL_MIN_TESTS := tests/test_fsdp_checkpoint_manager.py tests/test_verl_install.py \
	tests/test_verl_fsdp.py tests/test_verl_megatron.py tests/test_trinity_dropin.py

$(VERL_MIN_VENV)/.installed: pyproject.toml constraints.txt Makefile | $(UV_DEP)
	$(UV) venv --quiet --allow-existing --python python3 $(VERL_MIN_VENV)
	$(UVINSTALL) --python $(VERL_MIN_VENV)/bin/python -e ".[all]" "verl==0.7.1" "pyarrow<21"
	@touch $@

test-verl-min: $(VERL_MIN_VENV)/.installed
	$(VERL_MIN_VENV)/bin/python -c 'import verl; assert verl.__version__ == "0.7.1", verl.__version__'
	$(VERL_MIN_VENV)/bin/python $(COMPILE)
	$(VERL_MIN_VENV)/bin/python $(PYTEST) $(VERL_MIN_TESTS) $(PYTEST_ARGS)

# The demo's environment: the demo extra only (no test or lint tools); `make test`
# later adds the rest to the same environment.
$(VENV)/.installed-demo: pyproject.toml constraints.txt Makefile | $(UV_DEP)
	$(UV) venv --quiet --allow-existing --python python3 $(VENV)
	$(UVINSTALL) --python $(PY) -e ".[demo]"
	@touch $@

# obsckpt's Synchronizer against Trinity-RFT 0.6.0 as the registry has it (verl 0.8.0,
# NumPy 1.x, so pyarrow<21 as for test-verl-min): Trinity's own trainer, explorer and
# synchronizer code paths that run on a CPU, with obsckpt's Synchronizer substituted.
TRINITY_VENV ?= .venv-trinity
TRINITY_TESTS := tests/test_trinity_060.py tests/test_trinity_switch.py tests/test_synchronizer.py tests/test_trinity_dropin.py

$(TRINITY_VENV)/.installed: pyproject.toml constraints.txt Makefile | $(UV_DEP)
	$(UV) venv --quiet --allow-existing --python python3 $(TRINITY_VENV)
	$(UVINSTALL) --python $(TRINITY_VENV)/bin/python -e ".[all]" "trinity-rft==0.6.0" "pyarrow<21"
	@touch $@

test-trinity: $(TRINITY_VENV)/.installed
	$(TRINITY_VENV)/bin/python -c 'import importlib.metadata as m; v = m.version("trinity-rft"); assert v == "0.6.0", v'
	$(TRINITY_VENV)/bin/python $(COMPILE)
	$(TRINITY_VENV)/bin/python $(PYTEST) $(TRINITY_TESTS) $(PYTEST_ARGS)

# verl 0.9.1's own checkpoint tests, from its sdist (downloaded from the package index
# into build/verl-upstream/ and checked against its SHA-256), those that run on a CPU:
# as verl ships them, with obsckpt's managers in place (the documented differences must
# fail as documented), and verl's LoRA checkpoint tests saving into step directories.
test-verl-upstream: setup
	$(PY) tests/upstream/verl_checkpoint_tests.py --python $(PY)

demo: $(VENV)/.installed-demo
	@$(PY) -m compileall -q -j 0 obsckpt
	$(VENV)/bin/obsckpt demo

lint: setup
	$(VENV)/bin/ruff check obsckpt tests benchmarks dashboards
	$(VENV)/bin/ruff format --check obsckpt tests benchmarks dashboards

metrics-doc: setup
	$(PY) -c 'from obsckpt.telemetry.reference import reference_markdown as r; print(r(), end="")' > docs/metrics.md

# The dashboard, the alert rules and their promtool tests, and the copies the wheel
# ships (obsckpt/_assets, for `obsckpt dashboards export`). The alerts' runbook links
# point at OBSCKPT_RUNBOOK_URL when set (an absolute URL of docs/runbook.md).
dashboards: setup
	$(PY) -m dashboards.build

bench: setup
	$(PY) benchmarks/run.py --json benchmarks/results.json

bench-quick: setup
	$(PY) benchmarks/run.py --quick

# The regression guard: this tree's quick benchmarks against REF's (a worktree),
# alternating in this session on this machine. REF: the previous main (default: the
# commit before HEAD); ONLY: benchmarks to run (default: all); ROUNDS: runs of each.
REF ?= HEAD~1
ROUNDS ?= 2
bench-check: setup
	$(PY) benchmarks/check.py --ref $(REF) --rounds $(ROUNDS) $(if $(ONLY),--only $(ONLY),)

# On a machine with CUDA: every gpu-marked test and the GPU benchmarks, logs in LOG_DIR.
# Uses the machine's python3 (PYTHON=...), not the virtual environment.
LOG_DIR ?= gpu-check-logs
gpu-check:
	bash scripts/gpu_check.sh $(LOG_DIR)

clean:
	rm -rf $(VENV) $(VERL_MIN_VENV) $(TRINITY_VENV) .uv-tools .pytest_cache .hypothesis build/verl-upstream

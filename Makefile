# make test: set up a virtual environment with uv and run the whole suite.
# make demo: set up the same environment and run the main job.
VENV      ?= .venv
PY        := $(VENV)/bin/python
UV        ?= uv
# Local wheel folders (PIP_FIND_LINKS) carry the CPU build of torch; uv does not read that variable.
LINKDIRS  := $(or $(PIP_FIND_LINKS),$(wildcard /opt/wheels))
FINDLINKS := $(foreach d,$(LINKDIRS),--find-links $(d))
PYTEST_ARGS ?=

.PHONY: setup test demo lint metrics-doc dashboards bench bench-quick gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@command -v $(UV) >/dev/null 2>&1 || python3 -m pip install --quiet uv
	$(UV) venv --quiet --allow-existing --python python3 $(VENV)
	$(UV) pip install --quiet --python $(PY) $(FINDLINKS) -c constraints.txt -e ".[all]"
	@touch $@

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/obsckpt demo

lint: setup
	$(VENV)/bin/ruff check obsckpt tests benchmarks dashboards
	$(VENV)/bin/ruff format --check obsckpt tests benchmarks dashboards

metrics-doc: setup
	$(PY) -c 'from obsckpt.telemetry.metrics import reference_markdown as r; print(r(), end="")' > docs/metrics.md

dashboards: setup
	$(PY) -m dashboards.build

bench: setup
	$(PY) benchmarks/run.py --json benchmarks/results.json

bench-quick: setup
	$(PY) benchmarks/run.py --quick

# On a machine with CUDA: every gpu-marked test and the GPU benchmarks, logs in LOG_DIR.
# Uses the machine's python3 (PYTHON=...), not the virtual environment.
LOG_DIR ?= gpu-check-logs
gpu-check:
	bash scripts/gpu_check.sh $(LOG_DIR)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

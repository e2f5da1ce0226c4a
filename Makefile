# Two commands on a fresh machine: `make pretrain` and `make test`. Each installs what it needs (pinned) into .venv
# the first time, with a Python >= 3.12 it finds itself (launch/find_python.sh; or PYTHON=...). On a GPU machine:
# docs/quickstart-gpu.md.
PYTHON ?= $(shell launch/find_python.sh)
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 4
CONFIG ?= configs/tiny.yaml
ARGS ?=

.PHONY: pretrain test test-fast gpu-check data install clean

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-torch.txt requirements-nvrx.txt
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found (megatron-core 0.19 needs it): install Python 3.12 \
	(pyenv install 3.12, or your distribution's python3.12 with venv), or name one: make PYTHON=/path/to/python3.12" >&2; \
	exit 1; }
	# a .venv of an older Python (before megatron-core 0.19) is rebuilt from scratch
	$(PY) -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null || $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned and alone: an unpinned resolve could pull another build (several GB).
	$(PY) -m pip install -q -r requirements-torch.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	launch/install_nvrx.sh $(PY)
	touch $@

install: $(VENV)/.installed

data/tiny/stdlib_text_document.idx: $(VENV)/.installed
	$(PY) -m data_prep.prepare_default --out-dir data/tiny

data: data/tiny/stdlib_text_document.idx

pretrain: data
	OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore $(PY) -m recipes.launch --standalone --nproc-per-node $(NPROC) \
		--config $(CONFIG) $(ARGS)

# The suite in two parts: on every core (pytest-xdist, a test file at a time per worker; how many: tests/xdist_workers.py),
# then the tests marked serial alone (they measure wall-clock time or look at the machine's processes:
# pyproject.toml). --durations: the slowest tests, in every CI log, against the suite's 30-minute budget. ARGS go to
# both parts (-k, -x, ...); a part that selects nothing (pytest's exit 5) is not a failure.
TEST_WORKERS ?= $(shell $(PY) -m tests.xdist_workers)
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs --durations=15
define run_suite
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(1) $(ARGS); parallel=$$?; \
	$(PYTEST) -m serial $(1) $(ARGS); serial=$$?; \
	for rc in $$parallel $$serial; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done
endef

test: data
	$(call run_suite,tests)

test-fast: data
	$(call run_suite,tests/unit)

# The GPU checklist (recipes/gpu_check.py), with the machine's own CUDA torch and packages (Python >= 3.12), not .venv.
gpu-check:
	$(PYTHON) -m recipes.gpu_check $(ARGS)

clean:
	rm -rf runs

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

# --durations: the slowest tests, in every CI log, against the suite's 30-minute budget
test: data
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs --durations=15 tests $(ARGS)

test-fast: data
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs tests/unit $(ARGS)

# The GPU checklist (recipes/gpu_check.py), with the machine's own CUDA torch and packages (Python >= 3.12), not .venv.
gpu-check:
	$(PYTHON) -m recipes.gpu_check $(ARGS)

clean:
	rm -rf runs

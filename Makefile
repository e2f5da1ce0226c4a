# Two commands on a fresh machine: `make pretrain` and `make test`. Each installs what it needs
# (pinned) into .venv the first time, with a CPU torch. On a GPU machine: docs/quickstart-gpu.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0
NPROC ?= 4
CONFIG ?= configs/tiny.yaml
ARGS ?=

.PHONY: pretrain test test-fast gpu-check data install clean

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed

data/tiny/stdlib_text_document.idx: $(VENV)/.installed
	$(PY) -m data_prep.prepare_default --out-dir data/tiny

data: data/tiny/stdlib_text_document.idx

pretrain: data
	OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore $(PY) -m recipes.launch --standalone --nproc-per-node $(NPROC) \
		--config $(CONFIG) $(ARGS)

test: data
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs tests $(ARGS)

test-fast: data
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs tests/unit $(ARGS)

# The GPU checklist (recipes/gpu_check.py), with the machine's own CUDA torch and packages, not the CPU venv.
gpu-check:
	$(PYTHON) -m recipes.gpu_check $(ARGS)

clean:
	rm -rf runs

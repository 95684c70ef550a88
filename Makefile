# Quick start: `make run` (the main job on the local default) and `make test`.
# Both install what they need first; torch 2.13.0 comes first so that pip never
# pulls a multi-GB CUDA build for the `torch` range in setup.cfg.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
RANKS ?= 2

.PHONY: install run test test-fast lint docs bench jobs

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[train,test]"

run: install
	hpc run jobs/local_cpu.yaml --ppn $(RANKS)

test: install
	$(PYTHON) -m pytest -q

# The inner loop: everything but the real schedulers, MPI, several hosts, GPUs and the
# slow runs (markers in pyproject.toml; tests/conftest.py adds them by fixture).
test-fast: install
	$(PYTHON) -m pytest -q -m "not (slurm or pbs or mpi or multinode or gpu or slow)"

lint: install
	ruff check .
	ruff format --check .
	PYTHONPATH=src:. mypy  # strict on hpc/, default checks on src/ddp ([tool.mypy])
	PYTHONPATH=src:. lint-imports  # the layers (contracts in pyproject.toml)

docs: install
	$(PIP) install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 mkdocs build --strict

jobs: install
	hpc render --all-jobs

bench: install
	$(PYTHON) bench/render_vs_peers.py
	$(PYTHON) bench/trainer_vs_loop.py
	$(PYTHON) bench/checkpoint_save.py
	$(PYTHON) bench/fsdp_vs_ddp.py
	$(PYTHON) bench/data_scale.py

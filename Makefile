# The commands of the README. Each creates a virtual environment and installs what it needs (`make demo` and
# `make test`: the CPU torch wheel first, so pip never pulls the multi-GB CUDA build on a CPU machine).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
# pytest-xdist: one worker per core, at most four (each holds torch and transformers in memory). Most of the
# suite's time is subprocesses starting Python, torch and accelerate; two workers on two cores take 2/3 of it.
PARALLEL := -n auto --maxprocesses 4

# The floor environment: every dependency at setup.cfg's lower bound (.ci/floor_constraints.py reads them there),
# torch included: the oldest torch claimed, whatever build the registry serves (a CUDA build runs on the CPU too).
FLOOR_VENV := .venv-floor
FLOOR_PY   := $(FLOOR_VENV)/bin/python
# The Hugging Face-facing tests: config, remote code, modeling, generate/pipeline, evaluate, publishing,
# tokenizers, fine-tuning, pretraining end to end through accelerate (with checkpoint and exact resume), and a saved
# model with the demo recipe's non-edge bias through remote code; and the Triton kernels (interpreted, and compiled
# for sm_90) at the oldest triton claimed.
FLOOR_TESTS := tests/model/test_config.py tests/integration/test_remote_code.py tests/model/test_modeling.py tests/generation/test_generation.py \
	tests/integration/test_evaluation.py tests/integration/test_publishing.py tests/integration/test_tokenization.py tests/training/test_finetune.py \
	tests/training/test_pretrain.py::test_end_to_end_accelerate_launch \
	tests/training/test_pretrain.py::test_resume_gives_identical_loss_curve \
	tests/training/test_recipe_knobs.py::test_non_edge_bias_through_remote_code \
	tests/ops/test_triton_energy.py tests/ops/test_triton_recurrence.py tests/ops/test_triton_optim.py tests/ops/test_kernels_compile.py \
	tests/integration/test_clients.py

# The newest torch setup.cfg claims (pip picks the newest release inside the range, with the latest of everything
# else): a smoke test of the model package, generation and remote code.
LATEST_VENV  := .venv-latest
LATEST_PY    := $(LATEST_VENV)/bin/python
LATEST_TESTS := tests/model/test_config.py tests/model/test_modeling.py tests/generation/test_generation.py tests/integration/test_remote_code.py

.PHONY: demo test lint test-floor test-latest setup setup-floor setup-latest

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test,viz,gpu]"
	touch $@

setup: $(VENV)/.installed

# The clients the tests drive (TRL, lm-evaluation-harness): for `make test` only, not the demo.
$(VENV)/.clients: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test,viz,gpu,clients,lint,app,browser]"
	touch $@

$(FLOOR_VENV)/.installed: setup.cfg pyproject.toml .ci/floor_constraints.py
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install --quiet --upgrade pip
	$(PYTHON) .ci/floor_constraints.py setup.cfg > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_PY) -m pip install --quiet -c $(FLOOR_VENV)/constraints.txt -e ".[test,viz,gpu]"
	touch $@

setup-floor: $(FLOOR_VENV)/.installed

# A pip configuration's own constraints file may cap torch below setup.cfg's range: none applies to this
# environment, and test-latest checks that it got the newest torch claimed.
$(LATEST_VENV)/.installed: setup.cfg pyproject.toml Makefile
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install --quiet --upgrade pip
	PIP_CONSTRAINT=/dev/null $(LATEST_PY) -m pip install --quiet -e ".[test,gpu]"
	touch $@

setup-latest: $(LATEST_VENV)/.installed

# Main job: tokenizer + graph from the embedded corpus, pretrain a small BriLLM, evaluate, generate.
demo: setup
	$(VENV)/bin/accelerate launch -q --config_file configuration/accelerate/cpu_1.yaml examples/pretrain.py \
		--config demo --output_dir outputs/demo --overwrite_output_dir

# The whole suite on the latest releases.
test: setup $(VENV)/.clients
	$(PY) -m pytest -q $(PARALLEL)

# ruff's lint rules (pyproject.toml) over the whole repository.
lint: setup $(VENV)/.clients
	$(PY) -m ruff check .

# The Hugging Face-facing tests on the oldest versions setup.cfg claims. When the latest environment exists too,
# saved folders also cross between the two transformers versions (tests/integration/test_remote_code.py).
test-floor: setup-floor
	$(FLOOR_PY) .ci/floor_constraints.py --verify setup.cfg
	$(if $(wildcard $(PY)),BRILLM_OTHER_PYTHON=$(abspath $(PY))) $(FLOOR_PY) -m pytest -q $(PARALLEL) $(FLOOR_TESTS)

# The model package, generation and remote code at the newest torch setup.cfg claims.
test-latest: setup-latest
	$(LATEST_PY) -c "import torch, transformers; print('torch', torch.__version__, transformers.__version__)"
	$(LATEST_PY) .ci/floor_constraints.py --verify-newest torch setup.cfg
	$(LATEST_PY) -m pytest -q $(PARALLEL) $(LATEST_TESTS)

# The commands of the README. Each creates a virtual environment and installs what it needs (the CPU torch wheel
# first, so pip never pulls the multi-GB CUDA build on a CPU machine).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

# The floor environment: every dependency at setup.cfg's lower bound (.ci/floor_constraints.py reads them there).
FLOOR_VENV := .venv-floor
FLOOR_PY   := $(FLOOR_VENV)/bin/python
# The Hugging Face-facing tests: config, remote code, modeling, generate/pipeline, evaluate, publishing,
# tokenizers, fine-tuning, pretraining end to end through accelerate (with checkpoint and exact resume), and a saved
# model with the demo recipe's non-edge bias through remote code; and the Triton kernels (interpreted, and compiled
# for sm_90) at the oldest triton claimed.
FLOOR_TESTS := tests/test_config.py tests/test_remote_code.py tests/test_modeling.py tests/test_generation.py \
	tests/test_evaluation.py tests/test_publishing.py tests/test_tokenization.py tests/test_finetune.py \
	tests/test_pretrain.py::test_end_to_end_accelerate_launch tests/test_pretrain.py::test_resume_gives_identical_loss_curve \
	tests/test_recipe_knobs.py::test_non_edge_bias_through_remote_code \
	tests/test_triton_energy.py tests/test_triton_recurrence.py tests/test_triton_optim.py tests/test_kernels_compile.py

.PHONY: demo test test-floor setup setup-floor

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test,viz,gpu]"
	touch $@

setup: $(VENV)/.installed

$(FLOOR_VENV)/.installed: setup.cfg pyproject.toml .ci/floor_constraints.py
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install --quiet --upgrade pip
	$(FLOOR_PY) -m pip install --quiet "$(TORCH)"
	$(PYTHON) .ci/floor_constraints.py setup.cfg > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_PY) -m pip install --quiet -c $(FLOOR_VENV)/constraints.txt -e ".[test,viz,gpu]"
	touch $@

setup-floor: $(FLOOR_VENV)/.installed

# Main job: tokenizer + graph from the embedded corpus, pretrain a small BriLLM, evaluate, generate.
demo: setup
	$(VENV)/bin/accelerate launch -q --config_file configuration/accelerate/cpu_1.yaml examples/pretrain.py --config demo --output_dir outputs/demo

# The whole suite on the latest releases.
test: setup
	$(PY) -m pytest -q

# The Hugging Face-facing tests on the oldest versions setup.cfg claims. When the latest environment exists too,
# saved folders also cross between the two transformers versions (tests/test_remote_code.py).
test-floor: setup-floor
	$(FLOOR_PY) .ci/floor_constraints.py --verify setup.cfg
	$(if $(wildcard $(PY)),BRILLM_OTHER_PYTHON=$(abspath $(PY))) $(FLOOR_PY) -m pytest -q $(FLOOR_TESTS)

# The two commands of the README. Each creates .venv and installs what it needs (CPU torch wheel first,
# so pip never pulls the multi-GB CUDA build on a CPU machine).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: demo test setup

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test,viz,gpu]"
	touch $@

setup: $(VENV)/.installed

# Main job: tokenizer + graph from the embedded corpus, pretrain a small BriLLM, evaluate, generate.
demo: setup
	$(VENV)/bin/accelerate launch -q --config_file configuration/accelerate/cpu_1.yaml examples/pretrain.py --config demo --output_dir outputs/demo

test: setup
	$(PY) -m pytest -q

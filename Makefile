# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
# Both create .venv (with system site packages, so a preinstalled torch is reused), install
# prismllm with its test extras, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on disk here; never an unpinned torch (it pulls CUDA).
TORCH_PIN ?= torch==2.13.0
DEMO_OUT ?= out/demo

.PHONY: venv demo test test-gpu clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# The whole pipeline (capture -> time -> calibrate -> emulate) on a 32-rank gpt3d job.
demo: venv
	$(VENV)/bin/prism demo --out $(DEMO_OUT) --force

test: venv
	$(PY) -m pytest -q

# On a GPU machine (see README): the GPU-marked tests.
test-gpu: venv
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) out .pytest_cache

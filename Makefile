# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
# Both create .venv (with system site packages, so a preinstalled torch is reused), install
# prismllm with its test extras, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on disk here; never an unpinned torch (it pulls CUDA).
TORCH_PIN ?= torch==2.13.0
DEMO_OUT ?= out/demo
# The embedded default: examples/gpt3d.py, a tiny model that runs in seconds on two CPU cores, at 32
# ranks (TP2 x PP2 x DP8); the last rank runs for real in the emulation.
DEMO_ARGS := --tp 2 --pp 2 --layers 2 --hidden 32 --heads 4 --seq 16 --vocab 128 --micro-batch 1 \
             --global-batch 32 --iters 3

.PHONY: venv test-env demo test test-gpu check-extras clean

venv: $(VENV)/.installed
test-env: $(VENV)/.test-installed

# The package and what it needs to run. A Python that is itself a virtual environment (the GPU
# machines' /opt/torch/.venv holds torch) is not what --system-site-packages exposes, so its
# site-packages are added with a .pth file; no build isolation, so that nothing is fetched where
# everything is already there (GPU machines have no network).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PYTHON) -c "import site, sys; sys.prefix != sys.base_prefix and print(site.getsitepackages()[0])" \
		> "$$($(PY) -c 'import site; print(site.getsitepackages()[0])')/_prism_parent.pth"
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

# ... and what the tests use (pyproject's test extras; Holistic Trace Analysis without its
# declared requirements, which pull in Jupyter), and the training stacks the stack tests run
# (docs/stacks/): megatron-core, and torchtitan without its declared requirements (wandb and
# more), its imports being pyproject's torchtitan-imports extras. About 40 s more than the test extras
# alone in a fresh venv here (triton's wheel is 286 MB, 1 GB installed).
$(VENV)/.test-installed: $(VENV)/.installed
	$(PY) -m pip install -q --no-build-isolation -e '.[test,megatron,torchtitan-imports]'
	$(PY) -m pip install -q --no-deps holistictraceanalysis==0.5.0 torchtitan==0.3.0
	touch $@

# The whole pipeline (capture -> time -> calibrate -> emulate -> report) on the embedded default,
# on a GPU when there is one (one GPU: the sandbox rank and the assistant share it).
demo: venv
	$(VENV)/bin/prism run --world 32 --layout tp=2,pp=2 --sandbox 31 --out $(DEMO_OUT) --force \
		-- examples/gpt3d.py $(DEMO_ARGS)

# Test processes side by side (pytest-xdist), a test file each at a time (its module fixtures run
# once): on the 2-core CI machine two take the suite from 21 to 17 minutes (most tests wait on
# the processes they start as much as they compute).
TEST_WORKERS ?= 2

test: test-env
	$(VENV)/bin/ruff check prismllm tests benchmarks examples
	$(VENV)/bin/ruff format --check prismllm tests benchmarks examples
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Each extra installed by itself into a fresh venv and used as its page says (minutes; network).
check-extras:
	.ci/check-extras

# On a GPU machine (see README): the GPU-marked tests.
test-gpu: test-env
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) out .pytest_cache

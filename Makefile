# Two entry points, both idempotent: `make demo` and `make test`.
# torch is installed first and pinned so that pip takes the local CPU wheel and never
# resolves a multi-GB CUDA build to satisfy meshspeed's `torch>=2.4`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0

.PHONY: demo test install install-dev

# Each phase says what it does before pip starts: pip -q is silent for a minute or more,
# and without -q it prints a hundred lines of "Requirement already satisfied".
PIP := $(PY) -m pip install -q --disable-pip-version-check

$(PY):
	@echo "make: creating the virtual environment $(VENV) ($(PYTHON) -m venv)"
	@$(PYTHON) -m venv $(VENV)

$(VENV)/.core-installed: pyproject.toml | $(PY)
	@echo "make: installing $(TORCH) first (pinned, so pip takes a CPU wheel from your index or --find-links, not a multi-GB CUDA build; a minute or two)..."
	@$(PIP) $(TORCH)
	@echo "make: installing meshspeed (editable, from .) and its dependencies (pydantic, safetensors, ...)..."
	@$(PIP) -e .
	@touch $@
	@echo "make: installed; $(VENV)/bin/meshspeed is ready"

$(VENV)/.dev-installed: pyproject.toml $(VENV)/.core-installed
	@echo "make: installing the test dependencies (meshspeed[dev]: pytest, hypothesis, ...)..."
	@$(PIP) -e '.[dev]'
	@touch $@

install: $(VENV)/.core-installed
install-dev: $(VENV)/.dev-installed

demo: $(VENV)/.core-installed
	$(VENV)/bin/meshspeed demo $(ARGS)

test: $(VENV)/.dev-installed
	$(PY) -m pytest -q $(ARGS)

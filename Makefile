# Two entry points, both idempotent: `make demo` and `make test`.
# torch is installed first and pinned so that pip takes the local CPU wheel and never
# resolves a multi-GB CUDA build to satisfy meshspeed's `torch>=2.4`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0

.PHONY: demo test install install-dev

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.core-installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e .
	touch $@

$(VENV)/.dev-installed: pyproject.toml $(VENV)/.core-installed
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

install: $(VENV)/.core-installed
install-dev: $(VENV)/.dev-installed

demo: $(VENV)/.core-installed
	$(VENV)/bin/meshspeed demo $(ARGS)

test: $(VENV)/.dev-installed
	$(PY) -m pytest -q $(ARGS)

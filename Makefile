# Two entry points, both idempotent: `make demo` and `make test`.
# torch is installed first and pinned so that pip takes the local CPU wheel and never
# resolves a multi-GB CUDA build to satisfy meshspeed's `torch>=2.4`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0

.PHONY: demo test install install-dev docs-figures docs-figures-issue32

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

# Every table and picture in docs/ that a command makes (issue 32). Each command rewrites
# its own section between `<!-- name:start -->` and `<!-- name:end -->` and names the commit
# it measured; they refuse a tree with uncommitted code (benchmarks/docs_stamp.py): commit,
# then run. DeepSpeed's side needs its venv (../shared/tools/anchor-venv.sh). Several hours
# on a 2-core machine (ZeRO, MoE, long context and the 2B ZeRO-Infinity runs are the long
# ones). `docs-figures-issue32` is the part re-measured for issue 32: about 1.5 hours on a
# 2-core machine shared with other jobs (pipeline.py 29 min at --repeats 3, inference.py
# 4-6 min, the 2B runs 36 min at world 1 and about 30 at world 2), less on an idle one.
# Not run in CI. Hand-written reading notes under the sections ("-reading" markers) quote
# these numbers: re-read them after a run.
BENCH := PYTHONPATH=. $(PY) benchmarks
INFINITY_2B := --params 2e9 --steps 4 --buffer-count 8 --sub-group-size 20000000 --max-live 200000000 \
	--checkpoint-dir /tmp/meshspeed-docs-ck --write-docs
PIPELINE_PLOTS := 1f1b-p2-m8 zb-h1-p2-m8

docs-figures-issue32: $(VENV)/.dev-installed
	$(BENCH)/pipeline.py --warmup 2 --steps 3 --repeats 5 --json --timeline-dir benchmarks/results/pipeline-timelines --write-docs
	for t in $(PIPELINE_PLOTS); do \
	  $(VENV)/bin/meshspeed pipeline-plot --timeline benchmarks/results/pipeline-timelines/$$t.json -o docs/images/pipeline-$$t.png || exit 1; done
	$(BENCH)/inference.py --write-docs
	$(BENCH)/infinity.py $(INFINITY_2B) --world 1
	$(BENCH)/infinity.py $(INFINITY_2B) --world 2

docs-figures: docs-figures-issue32
	$(VENV)/bin/meshspeed plan --model benchmarks/configs/llama2-70b.json --gpus 64 --gpu-memory 80GB \
	  --link intra=900GB/s,inter=50GB/s --global-batch 512 --seq-len 4096 --plot docs/images/planner_70b.png
	$(BENCH)/adam.py --numel 32000000 --repeats 7
	$(BENCH)/offload.py --nvme-path /tmp/nvme --steps 4 --sub-group-size 1000000
	$(BENCH)/zero.py --wait-idle 20 --steps 14 --warmup 4 --repeats 3
	$(BENCH)/zero.py --wait-idle 20 --steps 20 --warmup 5 --shape vocab-heavy
	$(BENCH)/zero.py --wait-idle 20 --steps 20 --warmup 5 --shape layer-heavy
	$(BENCH)/zero.py --wait-idle 20 --steps 10 --warmup 3 --shape state-heavy
	$(BENCH)/zero.py --wait-idle 20 --steps 10 --warmup 3 --shape state-heavy --bf16
	$(BENCH)/zero.py --wait-idle 20 --steps 6 --warmup 2 --shape state-heavy --nproc 4
	$(BENCH)/zero.py --wait-idle 20 --steps 20 --warmup 5 --bf16
	$(BENCH)/pipeline_example.py --steps 20 --dropout off on --image-size 64 --repeats 2 --markdown --write-docs
	$(BENCH)/tensor_parallel.py --repeats 3 --markdown --write-docs
	$(BENCH)/tensor_parallel.py --repeats 3 --slow-link 5 --markdown --write-docs
	$(BENCH)/long_context.py --json --write-docs --with-deepspeed
	$(BENCH)/moe.py --json benchmarks/results/moe.json --write-docs
	$(BENCH)/compression.py --repeats 2 --write-docs
	$(BENCH)/compression.py --slow-link 5 --write-docs
	$(BENCH)/ds_checkpoint_roundtrip.py --write-docs
	$(BENCH)/hf_compat.py --write-docs

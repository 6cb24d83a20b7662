# make demo: create .venv, install everything, run the 2-rank ZeRO-3 training demo on CPU.
# make test: same install, run the test suite.
# make bench: same install plus the bench extra (DeepSpeed, matplotlib, pytest-benchmark), then the smoke runs of every
#             benchmark in its quick mode (make bench-smoke: benchmarks/smoke/), then benchmarks/run.py,
#             benchmarks/optimizer_step.py, benchmarks/first_step.py, benchmarks/deep_first_step.py, benchmarks/collectives.py, benchmarks/quantize.py,
#             benchmarks/onebit_bytes.py, benchmarks/whole_param_step.py, benchmarks/monitoring_overhead.py,
#             benchmarks/eager_flops_overhead.py,
#             benchmarks/step_breakdown.py, benchmarks/plan_llama70b.py, benchmarks/tune_llama70b.py, benchmarks/tune_ranking.py,
#             benchmarks/lr_schedules_vs_deepspeed.py, benchmarks/compile_collection.py, benchmarks/deep_stack.py
#             and the micro benchmarks
#             (results in benchmarks/results/).
# make gpu-check: on a machine with a CUDA device, the GPU paths (benchmarks/gpu_check.py).
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.zerocompile-installed
PYTHON  ?= python3
# a persistent inductor cache (outside the checkout, so fresh clones share it) keeps the
# few inductor tests and the demo fast after their first run
CACHE_HOME ?= $(if $(HOME),$(HOME)/.cache,$(CURDIR)/.cache)
export TORCHINDUCTOR_CACHE_DIR ?= $(CACHE_HOME)/zerocompile/inductor
# Python's bytecode cache, kept in the venv: with PYTHONDONTWRITEBYTECODE set (as it is in this
# project's CI machine's environment) no .pyc is ever written, and every new interpreter compiles
# every module it imports from source: importing torch, inductor, transformers and zerocompile took
# 9.5-10.5 s here instead of 3.9-4.2 s, in every test worker, every script and CLI run a test starts
# and every first-step benchmark's process (docs/benchmarks.md). The recipes below write the .pyc
# files under $(VENV)/pycache (PYTHONPYCACHEPREFIX), so the source tree stays without __pycache__,
# as PYTHONDONTWRITEBYTECODE keeps it; a prefix of your own is kept.
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX ?= $(abspath $(VENV))/pycache

.PHONY: install demo test bench bench-smoke gpu-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	# --no-compile: no .pyc for the ~14,000 installed modules up front (half the install's time); Python
	# writes one the first time a module is imported, so only the modules used get one
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_gpt.py --stage 3

# two pytest workers (pytest-xdist): most tests are one process on one core, so the suite takes
# about 15% less wall time on 2 cores; TEST_WORKERS=0 runs it in one process. Measured in fresh
# clones on 2026-12-06, the same hour: 3 workers took as long as 2 (1265 s of pytest against
# 1264 s), --dist loadfile with the slowest modules first longer (1516 s: the multi-rank modules
# ran side by side); one group of ranks at a time across the workers (a file lock) as long (1274 s:
# the waiting worker idled). The 25 slowest
# tests are listed at the end, to keep the suite near its 15-minute budget.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25 tests

# DeepSpeed is optional: if the extra does not install, the rest of it is tried alone and the
# benchmark reports the DeepSpeed rows as skipped
BENCH_EXTRA := $(VENV)/.zerocompile-bench-installed
$(BENCH_EXTRA): $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]' || $(PY) -m pip install --quiet matplotlib pytest-benchmark || true
	touch $(BENCH_EXTRA)

# every benchmark in its quick mode, end to end, with its figures checked (a few minutes); make bench runs it first
bench-smoke: $(BENCH_EXTRA)
	$(PY) -m pytest -q -p no:cacheprovider benchmarks/smoke

bench: bench-smoke
	$(PY) benchmarks/run.py
	$(PY) benchmarks/optimizer_step.py
	$(PY) benchmarks/first_step.py
	$(PY) benchmarks/deep_first_step.py
	$(PY) benchmarks/demo_first_step.py
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/stage3_vs_fsdp2.py --n-layers 6 --systems fsdp2 zero3 --out benchmarks/results/stage3_vs_fsdp2_6block.json
	$(PY) benchmarks/stage3_vs_fsdp2.py --n-layers 6 --graph-break-after 2 --systems fsdp2 zero3 --out benchmarks/results/stage3_vs_fsdp2_6block_break.json
	$(PY) benchmarks/stage3_vs_fsdp2.py --n-layers 6 --graph-break-in-loop --systems fsdp2 zero3 zero3-per-block --out benchmarks/results/stage3_vs_fsdp2_6block_loop_break.json
	TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) $(PY) benchmarks/stage3_vs_fsdp2.py --n-layers 12 --steps 3 --systems fsdp2 zero3 zero3-one-graph --out benchmarks/results/stage3_vs_fsdp2_12block_whole_cold.json
	TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) $(PY) benchmarks/stage3_vs_fsdp2.py --n-layers 12 --steps 3 --systems fsdp2 zero3-per-block --out benchmarks/results/stage3_vs_fsdp2_12block_per_block_cold.json
	$(PY) benchmarks/stage3_vs_fsdp2.py --n-layers 6 --inner-compiler eager --systems fsdp2 zero3 --out benchmarks/results/stage3_vs_fsdp2_6block-eager.json
	$(PY) benchmarks/stage3_vs_fsdp2.py --n-layers 6 --inner-compiler eager --peak-anatomy --systems fsdp2 zero3 --steps 2 --out benchmarks/results/stage3_vs_fsdp2_6block-anatomy.json
	$(PY) benchmarks/quantize.py
	$(PY) benchmarks/onebit_bytes.py
	$(PY) benchmarks/eager_flops_overhead.py
	$(PY) benchmarks/step_breakdown.py
	$(PY) benchmarks/plan_llama70b.py
	$(PY) benchmarks/plan_llama70b.py --compile blocks
	$(PY) benchmarks/tune_llama70b.py --compare-reuse
	$(PY) benchmarks/tune_llama70b.py --exact
	$(PY) benchmarks/tune_ranking.py
	$(PY) benchmarks/lr_schedules_vs_deepspeed.py | tee benchmarks/results/lr_schedules_vs_deepspeed.txt
	$(PY) benchmarks/whole_param_step.py
	$(PY) benchmarks/activation_offload.py
	$(PY) benchmarks/monitoring_overhead.py
	$(PY) benchmarks/watchdog_overhead.py
	$(PY) benchmarks/compile_collection.py
	$(PY) benchmarks/deep_stack.py
	$(PY) -m pytest benchmarks/micro --benchmark-only -q --benchmark-json benchmarks/results/micro.json

# the GPU paths (Triton kernels, NCCL stage-3 step, CUDA memory); says so and exits 0 without a GPU
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) .cache .pytest_cache *.egg-info

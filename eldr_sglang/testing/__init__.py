"""Test harness: real SGLang CPU clusters and stub workers.

* :mod:`eldr_sglang.testing.local_cluster` starts and stops real SGLang servers
  (and routers in front of them) as local processes;
* :mod:`eldr_sglang.testing.stub_worker` is a fake SGLang PD worker (prefill or
  decode) with failure knobs, in-process or as a script
  (``python -m eldr_sglang.testing.stub_worker``).

Used by the tests, the demo (``python -m eldr_sglang.demo``) and the benchmarks;
not needed in production (nothing in the plugin or the router imports it).
"""

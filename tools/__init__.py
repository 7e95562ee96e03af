"""Data and model tools, run from the repository root as ``python -m tools.<name>``.

* corpus and workloads: ``build_corpus``, ``corpus`` (loading and splitting it), ``build_workloads``;
* models: ``make_fixture_model`` (the tiny random test model), ``train_tiny_moe``,
  ``make_fat_expert_model``, ``routing_specialisation``;
* traces: ``trace_workloads``, ``record_prompt_traces``, ``record_long_decodes``;
* checks and CLIs: ``gpu_capture_check`` (the prepared GPU check; torch only), ``place_experts``.
"""

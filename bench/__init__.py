"""Benchmarks of vllm-nnrp-plugin (``python -m bench …``), run from a checkout's root.

Each module measures one thing and returns :class:`bench.results.Result` rows; :mod:`bench.suite` runs them
side by side and writes JSON + markdown under ``docs/benchmarks/``. Speed is measured here, never in tests;
the tests only run a short smoke of each module.
"""

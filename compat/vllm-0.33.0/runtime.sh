# Sourced by run-vllm-tests.sh / serve-and-chat.sh / run-conformance.sh (not part of the venv key).
# The grafted 0.33/0.34 environment (env.sh) runs on the CPU platform only with these, process-wide:
# VLLM_TARGET_DEVICE=cpu selects vLLM's CPU platform (else "Failed to infer device type"); CUDA_VISIBLE_DEVICES=""
# lets vLLM accept PyPI's triton with no active GPU driver (else "vLLM on x86 CPUs requires Triton"); and
# TRITON_INTERPRET=1 runs the model runner's Triton kernels in Triton's numpy interpreter (else the worker dies
# with "0 active drivers").
export VLLM_TARGET_DEVICE=cpu
export CUDA_VISIBLE_DEVICES=
export TRITON_INTERPRET=1

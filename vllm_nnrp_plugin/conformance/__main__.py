import sys

from vllm_nnrp_plugin.conformance.runner import main

sys.exit(main())

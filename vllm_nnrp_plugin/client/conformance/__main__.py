import sys

from vllm_nnrp_plugin.client.conformance.runner import main

sys.exit(main())

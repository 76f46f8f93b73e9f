"""``python -m vllm_nnrp_plugin.client.cli``: the ``vllm-nnrp`` command (:func:`vllm_nnrp_plugin.client.cli.main`)."""

import sys

from vllm_nnrp_plugin.client.cli import main

sys.exit(main())

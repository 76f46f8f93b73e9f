"""One binding per group of vLLM lines, one module per binding: everything this package knows about those lines —
the attach paths, the surfaces probed before the model loads, which engine lanes the lines allow and why not, the
quirks of their streams — is in that module (``v0_18`` … ``v0_34``).

Adding a line: a module declaring its :class:`~.surface.Binding` (copy the newest, change what differs), listed in
:data:`BINDINGS`, and a ``compat/vllm-<anchor>/`` environment to test it on. What the lanes rely on inside a line is
not declared: each lane proves it on the installed vLLM at start-up (:mod:`..self_check`).
"""

from vllm_nnrp_plugin.vllm_binding.lines import v0_18, v0_22, v0_26, v0_32, v0_34

#: every binding, oldest line first
BINDINGS = (v0_18.BINDING, v0_22.BINDING, v0_26.BINDING, v0_32.BINDING, v0_34.BINDING)

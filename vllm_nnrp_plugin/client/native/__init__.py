"""The client on nnrp-py's native runtime: :class:`~.profile_client.ProfileClient` (:mod:`.profile_client`), one
session over every carrier nnrp-py has, the oracle of nnrp-py's own client (exported by
:mod:`vllm_nnrp_plugin.client`). Its module is imported on first use only: nnrp-py's native client is slow to
import."""

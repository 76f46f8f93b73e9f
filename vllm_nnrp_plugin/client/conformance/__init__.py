"""Conformance harness for the ``openai-compatible/1`` part of the public ``nnrp-conformance`` suite (its
``profiles/openai-compatible/1`` recipes and ``schemas/api-profile-*.schema.json``), run against a live server.

* :mod:`.suite` finds the suite (``$NNRP_CONFORMANCE_ROOT``, else ``../shared/nnrp-conformance`` from the current
  directory) and loads suite manifests, recipes and schemas;
* :mod:`.plan` builds the execution plan: capability tokens from the server's manifest select recipes,
  ``${NAME}`` placeholders are substituted (pure);
* :mod:`.rules` checks one case's events against its ``expect`` and a results file against its plan with the
  suite's validation rules (pure);
* :mod:`.driver` runs every selected case over NNRP with
  :class:`vllm_nnrp_plugin.client.native.profile_client.ProfileClient`;
* :mod:`.runner` (``vllm-nnrp conformance`` / ``python -m vllm_nnrp_plugin.client.conformance``) ties them together and
  exits non-zero unless every selected case passed.
"""

"""vLLM side: entry points, the version gate, attaching to the API server, the chat backend.

Nothing here is imported by the rest of the package, so the package imports without vLLM.
"""

"""The operation core: what happens to one submitted operation, between the NNRP binding and the vLLM binding.

* :mod:`.operation` — an operation's lifecycle as one table, plain data (events in, decisions out; no I/O, no clock);
* :mod:`.adapter` — one operation → one backend call → ordered profile events → one terminal (awaits a backend);
* :mod:`.eager` — start a coroutine in the caller's own stack (the adapter's aborts start in the deciding callback);
* :mod:`.controls` — what NNRP's runtime controls (priority class, …) ask of an operation's backend request;
* :mod:`.limits` — admission limits: in-flight slots and per-session limits (plain bookkeeping).

Submodules are imported by name; this package imports none of them.
"""

"""What an operator sees of the operations: one record per operation and what is derived from it.

* :mod:`.observation` — the one :class:`~.observation.Observation` record per operation (plain data, times passed
  in): the source of its log line and diagnostics;
* :mod:`.metrics` — the Prometheus collectors fed from those records (``prometheus-client``);
* :mod:`.tracing` — one OpenTelemetry span per operation from its record (``opentelemetry-api``);
* :mod:`.log_safety` — client-controlled values made safe for a log line, and the rate limit of refusal log lines.

Submodules are imported by name; this package imports none of them.
"""

"""Telemetry: what a run did and how well, computed the same way for real runs and the simulator.

* :mod:`.spans`: :class:`Span` (one device running one token), :class:`Timeline` (a run's spans),
  :class:`SpanLog` (a real run's recorder), :func:`window_bubbles`.
* :mod:`.stats`: throughput, bubbles, staleness and overhead shares of a timeline (``summarize``).
* :mod:`.trace`: the Chrome/Perfetto ``trace.json`` and the Gantt PNG.
* :mod:`.metrics`: :class:`StepMetrics`, the one ``metrics.jsonl`` schema of every schedule, and
  :class:`MetricsLog` (metrics.jsonl and TensorBoard).
* :mod:`.live`: the live table on the terminal.

Telemetry imports nothing of the RL layers: span kinds and device roles are plain strings (the
schedule's ``TokenKind`` and ``Role`` are ``StrEnum``s of the same strings).
"""

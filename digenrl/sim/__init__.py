"""The simulator: real schedule objects on a virtual clock with a first-principles cost model.

* :mod:`.engine`: ``simulate(schedule, devices, workload, cost) -> Timeline`` (the same
  :class:`~digenrl.telemetry.spans.Timeline` a real run records, so :mod:`digenrl.telemetry` reads both).
* :mod:`.cost`, :mod:`.flops`, :mod:`.devices`, :mod:`.profiles`, :mod:`.calibration`: seconds per
  token from model FLOPs, device specs and a calibration on published runs.
* :mod:`.scenarios`, :mod:`.bench`: the paper's testbeds and ``digenrl bench bubbles``.
"""

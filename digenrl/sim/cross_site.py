"""Scenarios with far sites in ``bench bubbles``: their link traffic, their colocated baseline, their verdict.

A scenario with ``links`` (``scenarios._cross_site``, or a user file's ``[[pools]] link = ...``) has pools at far
sites behind slow links (``links.py``). In the bench:

- a disaggregated schedule runs on every pool, what crosses a link simulated (``link_traffic.py``);
- a colocated schedule runs on the home pools only (:func:`home_only`): every device of it all-reduces every step,
  which no one runs over a slow link; so ``speedup_vs_colocated`` compares with colocated on the training
  cluster alone;
- each row gets ``far_site`` (:func:`far_site_verdict`): its samples/s against the best the home pools reach
  alone (colocated there, or ``async1`` on them with the balanced split), and whether the far site is worth it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from digenrl.schedule.base import Device
from digenrl.sim.link_traffic import LinkBytes, LinkTraffic
from digenrl.sim.scenarios import Scenario

__all__ = ["home_only", "scenario_traffic", "far_site_verdict"]


def home_only(sc: Scenario) -> Scenario:
    """``sc`` without its far pools (the training cluster alone), named ``<name>@home``."""
    far = dict(sc.links)
    pools = tuple((t, n) for t, n in sc.pools if t not in far)
    return replace(sc, name=f"{sc.name}@home", pools=pools, links=(),
                   rollout_pool=sc.rollout_pool if sc.rollout_pool not in far else "")


def scenario_traffic(sc: Scenario, devices: list[Device], grad_bytes: float) -> LinkTraffic | None:
    """The link traffic of ``sc``'s devices (named ``<type>-<i>``), priced on its profile; None: no far pool."""
    if not sc.links:
        return None
    types = {t.lower(): t for t, _ in sc.pools}
    return LinkTraffic.for_devices({d.name: types[d.name.rsplit("-", 1)[0]] for d in devices}, dict(sc.links),
                                   LinkBytes.of_profile(sc.profile, grad_bytes=grad_bytes),
                                   sc.workload(1).trained_steps)


def far_site_verdict(sc: Scenario, rows: list[dict[str, Any]], num_batches: int) -> str:
    """Add ``far_site`` to each of ``sc``'s disaggregated ``rows`` (the home pools' best alone, the gain, worth it)
    and return the scenario's one-line verdict with the publication's figures."""
    from digenrl.sim.bench import simulate_pair
    from digenrl.telemetry.stats import summarize

    home = home_only(sc)
    colocated = [r["samples_per_s"] for r in rows if r["split"]["hybrid"]]  # already on the home pools
    async1 = summarize(simulate_pair(home, "async1", num_batches)).steady.samples_per_s
    best_home = max([async1, *colocated])
    link = dict(sc.links)
    prof = sc.profile
    gb = prof.publish_bytes / 1e9
    pubs = ", ".join(f"{t}@{lk}: a publication {gb:.3g} GB in {lk.seconds(prof.publish_bytes):.3g} s" for t, lk in link.items())
    best = None
    for r in rows:
        if r["split"]["hybrid"]:
            continue
        gain = r["samples_per_s"] / best_home - 1.0 if best_home else 0.0
        r["far_site"] = {"home_only_samples_per_s": best_home, "home_async1_samples_per_s": async1,
                         "gain": gain, "worth_it": gain > 0}
        if best is None or r["samples_per_s"] > best["samples_per_s"]:
            best = r
    if best is None:
        return f"{sc.name}: no disaggregated schedule ran, so the far site is not used"
    gain = best["far_site"]["gain"]
    step = sc.workload(1).samples_per_batch / best["samples_per_s"]
    return (f"{sc.name}: the far site is {'worth it' if gain > 0 else 'NOT worth it'}: {best['schedule']} on "
            f"{sc.testbed} {best['samples_per_s']:.3f} samples/s vs {best_home:.3f} on {home.testbed} alone "
            f"({gain:+.1%}); {pubs} (a step {step:.3g} s)")

"""The deployment's fleet figures: what a scaler reads from its coordinator (the gauges
`spotrl_coordinator_runs_active` and `spotrl_coordinator_preemptible_wanted`, and GET
/v1/fleet), and how they follow from the active runs. The coordinator publishes them
(`coordinator.step.record`, `coordinator.api.read_model`); `spotrl scale` follows them
(`services.cli.scale_decision`).

What `preemptible_wanted` means (`core.seeding.PoolSizer`, `coordinator.step.record`): N_prem
with headroom, at least 1, once a step is trained; null before (the run's status says "hold what
you can get"). The gauge writes that null as 0 ("0: all"), so 0, wherever it was read, means the
same as null: no figure (`known_figure`).
"""

from collections.abc import Sequence
from dataclasses import dataclass


def known_figure(wanted: int | None) -> int | None:
    """The figure a scaler can follow: None for null and for 0 (the gauge's null)."""
    if wanted is None or wanted <= 0:
        return None
    return wanted


@dataclass(frozen=True)
class FleetFigures:
    """What a deployment's scaler reads from its coordinator."""

    runs_active: int  # runs running or stalled (0: none, the pool goes to its minimum)
    preemptible_wanted: int  # the pool they want (0: no figure, or no run)


def fleet_figures(wanted_by_run: Sequence[int | None]) -> FleetFigures:
    """The figures of the active runs, given each one's `preemptible_wanted` (None: none yet).
    The pool wanted is their sum; 0 with no run, and while any active run has no figure yet: the
    scaler holds what runs until every run has said what it wants."""
    figures = [known_figure(w) for w in wanted_by_run]
    known = [f for f in figures if f is not None]
    wanted = sum(known) if len(known) == len(figures) else 0
    return FleetFigures(runs_active=len(figures), preemptible_wanted=wanted)

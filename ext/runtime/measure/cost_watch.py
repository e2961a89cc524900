"""Re-planning online: the installed plans' communication timed as training goes on, and the cost
model re-fitted from those times when the network changes.

1. Each iteration's communication is timed by its busy time: the time during which some op of its
   plan was in flight, from launch to completion (``PlanExecutor.take_busy_times``). Ops that share
   the link or queue behind one another count once, so a link's rate shows in it whatever the
   plan's concurrency. It includes any wait for the last rank to launch an op; on that rank it is
   the transfers alone, so a window's time is the minimum over the ranks of its median over
   `WINDOW` iterations (one all-reduce per window, started by every rank at the same iteration,
   samples or none, and read at the next: ``runtime.over_ranks``), per wire layout (a codec's
   layouts send different bytes).
2. A plan sends the same bytes every iteration, so it is compared with itself: after each
   installation (and one iteration to settle), its first window begins the reference, and each
   later window is judged against the reference windows: within the thresholds of step 3, it joins
   them (the last `REFERENCE_WINDOWS` are kept); past them, it is held. Held windows that do not
   persist were noise and join too, so that the reference windows' spread is the noise a change
   must stand out of. Until the reference is whole, a faster window replaces it: the windows before
   were the plans warming up. Beside the computation the ops take longer than the probes' isolated
   a + b·m; comparing a plan with itself leaves that out. The drift is a window's summed layouts'
   times over their reference times (each layout's median over the reference windows).
3. The network changed when a window's summed time is past `DRIFT` times the slowest reference
   window's (or below the fastest one's over `DRIFT`), by at least `SIGNIFICANT` of the iteration
   time, in `PERSIST` windows running, the same way. A link whose rate changes adds (or takes)
   wire time in proportion to the bytes, so the per-byte term moves by the summed change from the
   reference times over the summed bytes (``per_byte_change``);
   the latency a stays as probed (the ops' sharing of the link hides its change). Every
   collective's b moves in that proportion (``CostModel.rescaled_b``).
4. The runtime plans again on the re-fitted cost (a choosing planner times its new choice against
   the plans that ran), every rank at the same iteration, the plans' hashes checked as at wrap time (``runtime.installed``).
   Every rank decides on the same numbers, so every rank decides alike.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Hashable, Sequence

from ...cost import CostModel
from ..over_ranks import PendingReduction, StartReduction

WINDOW = 8  # iterations per comparison: one small all-reduce each, read at the next iteration
REFERENCE_WINDOWS = 3  # the reference: the last windows judged unchanged, at most this many
DRIFT = 1.5  # the communication this many times slower than its slowest reference window (or faster)...
SIGNIFICANT = 0.10  # ...by at least this fraction of the iteration time...
PERSIST = 2  # ...in this many windows running: the cost is re-fitted
FLOOR = 0.01  # a re-fitted b keeps at least this fraction of what it was


@dataclass(frozen=True)
class Replan:
    """One re-planning online, for the report and the log.

    Args:
        iteration: the iteration after which every rank switched to the new plans.
        drift: the communication's time over its reference (4.0: four times slower).
        before, after: the cost model the plans were made on, and the re-fitted one.
    """

    iteration: int
    drift: float
    before: CostModel
    after: CostModel

    def summary(self) -> str:
        """One line: when, why, and the per-byte term before and after."""
        return (f"iteration {self.iteration}: the communication took {self.drift:.2f}x its reference time; b "
                f"re-fitted from {self.before.b * 1e9:.3g} to {self.after.b * 1e9:.3g} ns/byte and plans made again")


def per_byte_change(sizes: Sequence[float], changes: Sequence[float]) -> float:
    """Δb: the summed change of time over the summed bytes (step 3 of the module docstring).

    Args:
        sizes: each layout's bytes per iteration.
        changes: each layout's time in the window less its reference, in seconds.
    """
    total = sum(sizes)
    return sum(changes) / total if total > 0 else 0.0


class CostWatch:
    """Times the installed plans' communication against its own reference (module docstring) and
    says when, and to what, the cost is re-fitted.

    Args:
        cost: the cost model the installed plans were made on.
        collective: their ops' collective (whose b of `cost` the change is added to).
        layouts: each wire layout of the installed plans with the bytes its ops send, in the same
            order on every rank.
        start: starts the reduction of a list of numbers to the least of each over the ranks
            (``over_ranks.reduction_over_ranks`` with MIN; ``over_ranks.on_this_rank`` alone).
    """

    def __init__(self, cost: CostModel, collective: str, layouts: list[tuple[Hashable, int]],
                 start: StartReduction):
        self.cost = cost
        self.b = cost.terms(collective)[1]
        self.layouts = layouts
        self.least = PendingReduction(start)
        self.settling = True  # the first iteration after an installation
        self.times: dict[Hashable, list[float]] = {}  # each layout's busy times in the window under way
        self.iteration_times: list[float] = []
        self.reference: list[list[float]] = []  # per reference window, each layout's time (inf: untimed)
        self.held: list[list[float]] = []  # the windows running past the thresholds, the same way...
        self.direction = 0  # ...1: slower, -1: faster
        self.drift = 1.0  # the last window's

    def observe(self, busy: list[tuple[Hashable, float]], iteration_time: float) -> CostModel | None:
        """After a steady iteration: the re-fitted cost when the plans should be made again (on
        every rank alike), else None. A window's times, reduced from the iteration that closes
        it, are judged at the next one.

        Args:
            busy: the (layout, busy seconds) of the iterations timed since the last call.
            iteration_time: the iteration's time, seconds.
        """
        if self.settling:
            self.settling = False
            return None
        refitted = self._window_over_ranks()
        for layout, seconds in busy:
            self.times.setdefault(layout, []).append(seconds)
        self.iteration_times.append(iteration_time)
        if len(self.iteration_times) >= WINDOW:
            local = [statistics.median(self.times[layout]) if layout in self.times else math.inf
                     for layout, _ in self.layouts]
            self.least.start(local + [statistics.median(self.iteration_times)])
            self.times, self.iteration_times = {}, []
        return refitted

    def _window_over_ranks(self) -> CostModel | None:
        """The last window's times, the least over the ranks: the reference, or judged against it."""
        least = self.least.take()
        if least is None:
            return None
        *medians, iteration = least
        if not self.reference:
            self.reference.append(medians)
            return None
        return self._judge(medians, iteration)

    def _judge(self, medians: list[float], iteration: float) -> CostModel | None:
        """Steps 2 and 3 of the module docstring on a window's times."""
        timed = [index for index, now in enumerate(medians)
                 if math.isfinite(now) and all(math.isfinite(window[index]) for window in self.reference)]
        windows = [sum(window[index] for index in timed) for window in self.reference]
        if min(windows) <= 0 or iteration <= 0:
            return None
        reference = [statistics.median(window[index] for window in self.reference) for index in timed]
        now = sum(medians[index] for index in timed)
        self.drift = now / sum(reference)
        slowest, fastest = max(windows), min(windows)
        slower = now >= DRIFT * slowest and now - slowest >= SIGNIFICANT * iteration
        faster = now <= fastest / DRIFT and fastest - now >= SIGNIFICANT * iteration
        direction = 1 if slower else -1 if faster else 0
        if direction == -1 and len(self.reference) < REFERENCE_WINDOWS:
            self.reference, self.held, self.direction = [medians], [], 0
            return None
        if direction == 0 or direction != self.direction:
            self.reference = (self.reference + self.held + ([] if direction else [medians]))[-REFERENCE_WINDOWS:]
            self.held, self.direction = [], direction
        if direction == 0:
            return None
        self.held.append(medians)
        if len(self.held) < PERSIST:
            return None
        change = per_byte_change([self.layouts[index][1] for index in timed],
                                 [medians[index] - before for index, before in zip(timed, reference)])
        return self.cost.rescaled_b(max(self.b + change, FLOOR * self.b) / self.b)

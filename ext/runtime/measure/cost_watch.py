"""Re-planning online: the installed plans' communication timed as training goes on, and the cost
model re-fitted from those times when the network changes.

1. Each iteration's communication is timed by its busy time: the time during which some op of its
   plan was in flight, from launch to completion (``PlanExecutor.take_busy_times``). Ops that share
   the link or queue behind one another count once, so a link's rate shows in it whatever the
   plan's concurrency. It includes any wait for the last rank to launch an op; on that rank it is
   the transfers alone, so a window's time is the minimum over the ranks of its median over
   `WINDOW` iterations (one all-reduce per window with the other watchers', started by every rank
   at the same iteration, samples or none, and read at the next: ``runtime.over_ranks``), per wire
   layout (a codec's layouts send different bytes).
2. A plan sends the same bytes every iteration, so it is compared with itself: after each
   installation (and one iteration to settle), the first `REFERENCE_WINDOWS` windows running that
   agree (their summed times within `AGREE` of each other, or apart by less than `SIGNIFICANT` of
   the iteration time) give each layout its reference time, the median of its times in them; after
   `MAX_REFERENCE_WINDOWS` windows without such a run, the median over all of them. A burst of load
   on the host while the reference is timed would otherwise stand for the link's rate until the
   next installation, and its end read as a faster network. Beside the computation the ops take
   longer than the probes' isolated a + b·m; comparing a plan with itself leaves that out. In every
   later window, the drift is the summed layouts' times over their summed references.
3. The network changed when the drift is past `DRIFT` either way (slower or faster by that factor)
   and the change is at least `SIGNIFICANT` of the iteration time and `NOTICEABLE` seconds, in
   `PERSIST` windows running, the same way. The floor in seconds keeps a model whose ops take
   a fraction of a millisecond from re-planning on the host's noise: a gloo thread that waits a
   scheduler's time slice for a core on a busy host stretches such ops several times over (on 2
   loopback ranks, windows at 2.0 and 1.5 ms against a reference of 0.38 ms re-planned about one
   run in six), while a link whose rate changes moves them by milliseconds. A link whose rate
   changes adds (or takes) wire time in proportion to the bytes, so the per-byte term moves by
   the summed change over the summed bytes (``per_byte_change``); the latency a stays as probed
   (the ops' sharing of the link hides its change). Every collective's b moves in that proportion
   (``CostModel.rescaled_b``).
4. The runtime plans again on the re-fitted cost (a choosing planner times its new choice against
   the plans that ran), every rank at the same iteration, the plans' hashes checked as at wrap
   time (``runtime.installed``).
   Every rank decides on the same numbers, so every rank decides alike.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Hashable, Sequence

from ...cost import CostModel
from ..over_ranks import PendingReduction, StartReduction

WINDOW = 8  # iterations per comparison, reduced with the other watchers' and read at the next iteration
DRIFT = 1.5  # the communication this many times slower (or faster) than its reference...
SIGNIFICANT = 0.10  # ...by at least this fraction of the iteration time...
NOTICEABLE = 2e-3  # ...and this many seconds an iteration...
PERSIST = 2  # ...in this many windows running: the cost is re-fitted
FLOOR = 0.01  # a re-fitted b keeps at least this fraction of what it was
REFERENCE_WINDOWS = 2  # this many windows running that agree form the reference...
AGREE = math.sqrt(DRIFT)  # ...their summed times this close (a steady link stays as far from DRIFT)
MAX_REFERENCE_WINDOWS = 5  # ...or, failing that, this many windows (the median over them)


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
        start: starts the reduction of a list of numbers to the least of each over the ranks (a
            MIN reduction of the installed plans' ``over_ranks.CombinedReductions``;
            ``over_ranks.on_this_rank`` alone).
    """

    def __init__(self, cost: CostModel, collective: str, layouts: list[tuple[Hashable, int]],
                 start: StartReduction):
        self.cost = cost
        self.b = cost.terms(collective)[1]
        self.layouts = layouts
        self.least = PendingReduction(start)
        self.times: dict[Hashable, list[float]] = {}  # each layout's busy times in the window under way
        self.iteration_times: list[float] = []
        self.reference: list[float] | None = None  # each layout's reference time (inf: never timed)
        self.reference_windows: list[tuple[list[float], float]] = []  # the windows timed for it so far
        self.drifting = 0  # windows running past the thresholds: > 0 slower, < 0 faster
        self.drift = 1.0  # the last window's

    def observe(self, busy: list[tuple[Hashable, float]], iteration_time: float) -> CostModel | None:
        """After a steady iteration: the re-fitted cost when the plans should be made again (on
        every rank alike), else None. A window's times, reduced from the iteration that closes
        it, are judged at the next one.

        Args:
            busy: the (layout, busy seconds) of the iterations timed since the last call.
            iteration_time: the iteration's time, seconds.
        """
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
        if self.reference is None:
            self._form_reference(medians, iteration)
            return None
        return self._judge(medians, iteration)

    def _form_reference(self, medians: list[float], iteration: float) -> None:
        """Step 2 of the module docstring: the reference, once the windows timed so far settle it."""
        self.reference_windows.append((medians, iteration))
        running = self.reference_windows[-REFERENCE_WINDOWS:]
        if len(running) == REFERENCE_WINDOWS and _agree(running):
            chosen = running
        elif len(self.reference_windows) >= MAX_REFERENCE_WINDOWS:
            chosen = self.reference_windows
        else:
            return
        self.reference = [statistics.median(times) for times in zip(*(medians for medians, _ in chosen))]
        self.reference_windows = []

    def _judge(self, medians: list[float], iteration: float) -> CostModel | None:
        """Steps 2 and 3 of the module docstring on a window's times."""
        timed = [(size, before, now) for (_, size), before, now in zip(self.layouts, self.reference, medians)
                 if math.isfinite(before) and math.isfinite(now)]
        before, now = sum(before for _, before, _ in timed), sum(now for _, _, now in timed)
        if before <= 0 or iteration <= 0:
            return None
        self.drift = now / before
        significant = abs(now - before) >= max(SIGNIFICANT * iteration, NOTICEABLE)
        direction = (1 if self.drift >= DRIFT else -1 if self.drift <= 1 / DRIFT else 0) if significant else 0
        same_way = direction != 0 and self.drifting * direction >= 0
        self.drifting = self.drifting + direction if same_way else direction
        if abs(self.drifting) < PERSIST:
            return None
        change = per_byte_change([size for size, _, _ in timed], [now - before for _, before, now in timed])
        return self.cost.rescaled_b(max(self.b + change, FLOOR * self.b) / self.b)


def _agree(windows: list[tuple[list[float], float]]) -> bool:
    """Whether the windows' summed times (over the layouts each of them timed) lie within `AGREE`
    of each other, or apart by less than `SIGNIFICANT` of their longest iteration."""
    timed = [all(math.isfinite(medians[index]) for medians, _ in windows) for index in range(len(windows[0][0]))]
    sums = [sum(time for time, kept in zip(medians, timed) if kept) for medians, _ in windows]
    longest = max(iteration for _, iteration in windows)
    return max(sums) <= AGREE * min(sums) or max(sums) - min(sums) < SIGNIFICANT * longest

"""Plan trials: the plans of a planner that chooses among others (``auto``) timed on the live job,
the baseline kept unless another is faster with confidence, and the choice checked afterwards.

The simulator ranks plans; the job decides. Two plans the simulator predicts a few percent apart can
run in the other order (its host-time and slowdown terms are means), and single iterations are
noisier than the differences being ranked. So the trials are a sequential paired comparison:

1. the alternatives (``planning.plan_alternatives``: the baseline, torch DDP's buckets, first) are
   visited in rounds, each plan once per round for `iterations` timed iterations after one to
   settle the switch, the order reversed every other round so that a drifting host weighs on all
   alike; a visit's time is the median of its iterations, the slowest rank's;
2. after each pair of rounds (forth and back: a steady drift cancels), each challenger's gain over
   the baseline is the mean over rounds of log(baseline's visit / challenger's visit) (paired within
   a round), with a one-sided Student-t bound (``judge``); a pair of rounds whose visits ran over
   `HOST_BURST` times the median pair's (``steady_rounds``) is set aside: a burst of load on the
   host slows every plan, and its rounds' ratios, far apart, would swamp every later look;
3. a challenger wins when its lower bound is above 0: at interim looks at level 1 − 0.001, at the
   last look (the time budget, `trial_seconds`, spent at the end of a pair of rounds, or
   `MAX_ROUNDS` run) at half the stated error rate, each divided among the challengers
   (Haybittle–Peto boundaries with a Bonferroni split); a challenger is dropped when its upper
   bound at the confidence is below the planner's `tolerance` (it cannot be worth a change);
4. the trials stop when every challenger has won or been dropped, or at the last look; the winner
   with the largest gain is kept, else the baseline;
5. where the last look leaves challengers undecided, the comparison goes on as training does: every
   `FOLLOW_UP_EVERY` iterations of the kept plan, one more pair of rounds of it and the undecided
   challengers, judged with the rounds before (interim looks at 1 − 0.001) until a challenger wins
   (auto switches to it) or is dropped, or `MAX_FOLLOW_UP_ROUNDS` rounds are in: that last look
   spends the other half of the error rate, so over all looks it stays within 1 − confidence.

Afterwards ``ChoiceWatch`` compares the kept plan's iteration times with the trial times: when they
stay slower than the kept plan and every other plan ran in the trials, by more than ``RETRIAL_DRIFT``
(the network or the host changed), the trials run again.
Every decision is taken on values all-reduced over the ranks, so every rank takes it at the same
iteration; each installation is hash-checked.
"""
from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from scipy.stats import t as student_t

from ...agreement import waiting_for
from ...compress import Codec
from ...cost import CostModel
from ...planners import BoundPlanner
from ...plan import ALLREDUCE
from ...planning import TRIAL_PREDICTION_LIMIT, Alternative, plan_alternatives
from ...profile import ModelProfile
from ..channels import Channels
from ..over_ranks import PendingReduction, StartReduction
from . import Install, IterationDone, Measurement, TrialsDone, median, now

TRIAL_ITERATIONS = 2  # timed per visit of a plan, after one to settle; rounded up to whole codec cycles
MIN_ROUNDS = 4  # rounds before the first look, whatever the time budget
MAX_ROUNDS = 16  # the last look at the latest (a fast model's budget in time would allow many more)
FOLLOW_UP_EVERY = 64  # iterations of the kept plan before each follow-up pair of rounds
MAX_FOLLOW_UP_ROUNDS = 64  # rounds, the trials' own included, at which the follow-up's last look decides
LAST_LOOK_SHARE = 0.5  # of the error rate, spent by each of the two last looks (the trials', the follow-up's)
INTERIM_ALPHA = 0.001  # a challenger's error level at interim looks (Haybittle–Peto)
HOST_BURST = 2.0  # a pair of rounds this many times slower than the median pair is set aside
WATCH_WINDOW = 16  # iterations per comparison of the kept plan with the trial times (their lower quartile)
RETRIAL_DRIFT = 0.10  # the kept plan this much slower than every plan in its trials, twice running: trials again
RETRIAL_COOLDOWN = 256  # iterations after the trials before the watch may start them again

log = logging.getLogger("gradsync")


@dataclass(frozen=True)
class Verdict:
    """What the trials concluded.

    Args:
        kept: the index of the alternative kept (0: the baseline).
        settled: every challenger won or was dropped (False: the budget ran out first).
        gains: each alternative's estimated speed-up over the baseline (0.05: 5% faster; 0 for it).
        margins: the half-widths of those estimates at the stated confidence.
        rounds: the rounds the trials ran.
        undecided: the challengers that neither won nor were dropped (empty where settled).
        set_aside: the rounds left out as bursts of host load (``steady_rounds``).
    """

    kept: int
    settled: bool
    gains: tuple[float, ...]
    margins: tuple[float, ...]
    rounds: int
    undecided: tuple[int, ...] = ()
    set_aside: int = 0


def steady_rounds(rounds: list[list[float]]) -> list[list[float]]:
    """The rounds judged (step 2 of the module docstring): those of each pair (forth, back; a last
    round alone) whose level, the median of its visits, is at most `HOST_BURST` times the median
    pair's level. The median stands for the host's usual speed while most pairs ran at it: a burst
    is set aside once the pairs around it outnumber it."""
    pairs = [rounds[start:start + 2] for start in range(0, len(rounds), 2)]
    levels = [statistics.median(visit for visits in pair for visit in visits) for pair in pairs]
    usual = statistics.median(levels)
    return [visits for pair, level in zip(pairs, levels) if level <= HOST_BURST * usual for visits in pair]


def judge(rounds: list[list[float]], confidence: float, tolerance: float, last: bool) -> Verdict | None:
    """The verdict on trial rounds so far (steps 2–5 of the module docstring), None while undecided
    (or before `MIN_ROUNDS`, or after an odd number of rounds).

    Args:
        rounds: per round, each alternative's visit time in seconds, the baseline first.
        confidence: the stated confidence (e.g. 0.95).
        tolerance: a challenger that cannot be faster than the baseline by this fraction is dropped.
        last: a last look (the trials' budget spent, or the follow-up's last round in): decide
            whatever the evidence, at `LAST_LOOK_SHARE` of the error rate.
    """
    count, looks = len(rounds[0]), len(rounds)
    if count == 1:
        return Verdict(0, True, (0.0,), (0.0,), looks)
    if (looks < MIN_ROUNDS or looks % 2) and not last:
        return None
    steady = steady_rounds(rounds)
    set_aside, judged = looks - len(steady), len(steady)
    if judged < 2:  # no spread to judge by: the baseline
        return Verdict(0, False, (0.0,) * count, (math.inf,) * count, looks, tuple(range(1, count)), set_aside)
    challengers = count - 1
    winning = 1 - ((1 - confidence) * LAST_LOOK_SHARE if last else INTERIM_ALPHA) / challengers
    win_quantile = student_t.ppf(winning, judged - 1)
    quantile = student_t.ppf(confidence, judged - 1)
    worth = -math.log(1 - tolerance)  # the log-gain of a plan faster by `tolerance`
    gains, margins, winners, undecided = [0.0], [0.0], [], []
    for index in range(1, count):
        logs = [math.log(visits[0] / visits[index]) for visits in steady]
        mean = statistics.fmean(logs)
        error = statistics.stdev(logs) / math.sqrt(judged)
        gains.append(math.expm1(mean))
        margins.append(math.expm1(mean + quantile * error) - math.expm1(mean))
        if mean - win_quantile * error > 0:
            winners.append(index)
        elif mean + quantile * error >= worth:
            undecided.append(index)
    if undecided and not last:
        return None
    kept = max(winners, key=lambda index: gains[index], default=0)
    return Verdict(kept, not undecided, tuple(gains), tuple(margins), looks, tuple(undecided), set_aside)


@dataclass(frozen=True)
class TrialResult:
    """The trials' outcome, for the report and the log.

    Args:
        labels: each alternative's label (the planner its steady plans come from), the baseline first.
        seconds: each alternative's median visit time over the rounds, the slowest rank's.
        predicted: each alternative's predicted step time (the simulator's).
        verdict: the decision.
        iterations: the iterations the trials took, settling ones included.
    """

    labels: tuple[str, ...]
    seconds: tuple[float, ...]
    predicted: tuple[float, ...]
    verdict: Verdict
    iterations: int

    @property
    def kept(self) -> str:
        return self.labels[self.verdict.kept]

    @property
    def follow_up_due(self) -> bool:
        """The baseline kept with challengers undecided, and rounds left before the follow-up's last look."""
        verdict = self.verdict
        return verdict.kept == 0 and bool(verdict.undecided) and verdict.rounds < MAX_FOLLOW_UP_ROUNDS

    def summary(self) -> str:
        """One line: what was kept and why."""
        verdict, baseline = self.verdict, self.labels[0]
        compared = ", ".join(f"{label} {gain:+.1%} ± {margin:.1%}" for label, gain, margin
                             in zip(self.labels[1:], verdict.gains[1:], verdict.margins[1:]))
        aside = f", {verdict.set_aside} set aside as bursts of host load" if verdict.set_aside else ""
        taken = f"{verdict.rounds} rounds{aside}, {self.iterations} iterations"
        if verdict.kept:
            why = f"faster than {baseline} with confidence"
        elif verdict.settled:
            why = "no other plan faster with confidence"
        elif self.follow_up_due:
            why = (f"the trial budget ran out before any other plan was found faster with confidence; the undecided "
                   f"ones are timed again every {FOLLOW_UP_EVERY} iterations")
        else:
            why = f"no other plan found faster with confidence in {verdict.rounds} rounds"
        line = f"kept {self.kept}: {why} ({taken}; speed-up over {baseline}: {compared})"
        if not verdict.settled:
            spread = max(self.predicted) / min(self.predicted) - 1
            line += f"; the simulator predicts them within {spread:.1%} of each other"
        return line


class PlanTrials(Measurement):
    """Times the plans of `alternatives` on the live job and keeps one (module docstring).

    Args:
        profile: the measured profile the plans are made on.
        alternatives: the plans to time, the baseline first (``planning.plan_alternatives``).
        iterations: timed iterations per visit.
        planner: the wrapped scheduler (its `confidence`, `tolerance` and `trial_seconds`).
        channels: for the all-reduce of the ranks' visit times.
        device: the model's device (timing waits for its queued work).
        watch_reduction: starts the reduction of the choice watch's windows to the largest over the
            ranks (the installed plans' ``over_ranks.CombinedReductions``).
        follow_up_of: the trials (or the follow-up) whose undecided challengers these follow-up
            rounds time again (step 5 of the module docstring): their rounds, restricted to
            `alternatives`, come first; None for the trials themselves.
    """

    def __init__(self, profile: ModelProfile, alternatives: list[Alternative], iterations: int,
                 planner: BoundPlanner, channels: Channels, device: torch.device, watch_reduction: StartReduction,
                 follow_up_of: "PlanTrials | None" = None):
        self.profile = profile
        self.alternatives = alternatives
        self.iterations = iterations
        self.planner = planner
        self.channels = channels
        self.device = device
        self.watch_reduction = watch_reduction
        self.rounds: list[list[float]] = []  # the slowest rank's visit times, per round
        self.watch: ChoiceWatch | None = None  # a follow-up's: the watch that started it, continued after
        if follow_up_of is not None:
            columns = [follow_up_of.alternatives.index(alternative) for alternative in alternatives]
            self.rounds = [[visits[column] for column in columns] for visits in follow_up_of.rounds]
        self.visits = [0.0] * len(alternatives)  # this rank's, in the round under way
        self.position = 0  # in this round's order
        self.samples: list[float] = []  # the visit under way
        # the next iteration still applies the previous plan's deferred updates (a follow-up starts
        # with the plans installed: no switch)
        self.settling = follow_up_of is None
        self.iterations_taken = 0 if follow_up_of is None else follow_up_of.iterations_taken
        self.started = self.last_end = now(device)

    @classmethod
    def start(cls, profile: ModelProfile, cost: CostModel, codec: Codec, planner: BoundPlanner, count: int,
              channels: Channels, device: torch.device, watch_reduction: StartReduction,
              collective: str = ALLREDUCE, incumbent: BoundPlanner | None = None) -> "PlanTrials | None":
        """Trials of up to `count` plans of `planner` (install ``first`` now); None when there is
        nothing to compare (a planner that does not choose, `count` < 2, or every candidate makes
        the same plans).

        Args:
            profile, cost: what the plans are made on.
            codec: the compressor, set up (visits last whole cycles of its steady rounds).
            planner: the wrapped scheduler, bound.
            count: ``wrap``'s `plan_trials`.
            channels, device, watch_reduction: as the constructor's.
            collective: the plans' ops' (``planning.plan_layouts``).
            incumbent: the planner whose plans run now, the baseline in place of torch DDP's
                buckets (``planning.plan_alternatives``).
        """
        if count < 2 or not planner.chooses:
            return None
        alternatives = plan_alternatives(profile, cost, codec, planner, count, collective, incumbent)
        if len(alternatives) < 2:
            if channels.rank == 0:
                log.info("gradsync auto: kept %s without plan trials: no other candidate makes other plans predicted "
                         "within %gx its time", alternatives[0].label, TRIAL_PREDICTION_LIMIT)
            return None
        cycle = len(codec.steady_rounds())  # whole cycles (ACP-SGD: a P step and a Q step)
        return cls(profile, alternatives, cycle * math.ceil(TRIAL_ITERATIONS / cycle), planner, channels, device,
                   watch_reduction)

    def again(self) -> "PlanTrials":
        """The same trials from the start."""
        return PlanTrials(self.profile, self.alternatives, self.iterations, self.planner, self.channels, self.device,
                          self.watch_reduction)

    def follow_up(self, undecided: tuple[int, ...]) -> "PlanTrials":
        """One more pair of rounds of the baseline and the challengers `undecided` (indices)."""
        alternatives = [self.alternatives[index] for index in (0, *undecided)]
        return PlanTrials(self.profile, alternatives, self.iterations, self.planner, self.channels, self.device,
                          self.watch_reduction, follow_up_of=self)

    def handed_over(self, watch: "ChoiceWatch") -> None:
        """A follow-up starts now, from `watch` (made at an earlier decision, its clock starts
        here: the kept plan's iterations in between are no visit's)."""
        self.watch = watch
        self.started = self.last_end = now(self.device)

    def order(self, round_index: int) -> list[int]:
        """The visiting order of a round: forth, then back (0 1 2, 2 1 0, 0 1 2, ...)."""
        forth = list(range(len(self.alternatives)))
        return forth if round_index % 2 == 0 else forth[::-1]

    @property
    def first(self) -> Install:
        """The plans the trials start with (a follow-up's: the kept baseline's)."""
        return Install(self.profile, self.alternatives[self.order(len(self.rounds))[0]].planner)

    def iteration_done(self, done: IterationDone) -> Install | TrialsDone | None:
        ended = now(self.device)
        started, self.last_end = self.last_end, ended
        self.iterations_taken += 1
        if self.settling:
            self.settling = False
            return None
        if done.skipped:  # a step skipped for non-finite gradients (on every rank) is no sample
            return None
        self.samples.append(ended - started)
        if len(self.samples) < self.iterations:
            return None
        order = self.order(len(self.rounds))
        self.visits[order[self.position]] = median(self.samples)
        self.samples, self.position = [], self.position + 1
        if self.position < len(order):
            self.settling = True
            return Install(self.profile, self.alternatives[order[self.position]].planner)
        return self._end_round()

    def _end_round(self) -> TrialsDone | None:
        """Gather the round's visit times (the slowest rank's) and judge; the next round starts
        with the plan that ends this one (no switch). A follow-up ends after its pair of rounds,
        decided or not."""
        gathered = torch.tensor([*self.visits, now(self.device) - self.started], dtype=torch.float64,
                                device=self.device)
        with waiting_for("the plan trials' result", self.channels.timeout):
            dist.all_reduce(gathered, op=dist.ReduceOp.MAX, group=self.channels.process_group)
        *visits, elapsed = gathered.tolist()
        self.rounds.append(visits)
        self.position = 0
        looks = len(self.rounds)
        if self.watch is None:
            last = looks >= MIN_ROUNDS and looks % 2 == 0 and (elapsed >= self.planner.trial_seconds
                                                               or looks >= MAX_ROUNDS)
        else:
            last = looks >= MAX_FOLLOW_UP_ROUNDS and looks % 2 == 0
        verdict = judge(self.rounds, self.planner.confidence, self.planner.tolerance, last)
        if verdict is None and self.watch is not None and looks % 2 == 0:  # undecided: again later
            again = self.follow_up(tuple(range(1, len(self.alternatives))))
            return TrialsDone(None, self.watch.result, self.watch.continued(again))
        if verdict is None:
            return None
        installed = self.order(len(self.rounds) - 1)[-1]
        result = TrialResult(tuple(a.label for a in self.alternatives),
                             tuple(statistics.median(column) for column in zip(*self.rounds)),
                             tuple(a.predicted for a in self.alternatives), verdict, self.iterations_taken)
        if self.channels.rank == 0:
            log.info("gradsync auto: %s%s", "follow-up rounds: " if self.watch is not None else "", result.summary())
        kept = None if verdict.kept == installed else self.alternatives[verdict.kept].planner
        follow_up = self.follow_up(verdict.undecided) if result.follow_up_due else None
        if self.watch is None:
            return TrialsDone(kept, result, ChoiceWatch(self, result, follow_up))
        return TrialsDone(kept, result, self.watch.continued(follow_up, result))


class ChoiceWatch:
    """Checks the kept plan as training goes on.

    Every `WATCH_WINDOW` iterations its iteration times are compared with the trial times (the
    slowest rank's lower quartile of the window, reduced from the iteration that closes the window
    and read at the next: ``runtime.over_ranks``): slower than the kept plan's median visit and the
    fastest other plan's by more than `RETRIAL_DRIFT` (``reference``) in two windows running, at least
    `RETRIAL_COOLDOWN` iterations after the trials, starts them again. The lower quartile moves when
    every iteration slows, not when some stall (a pause in training, other work on the host), and
    the kept plan is timed again only when it runs slower than any plan ran. Where the trials left
    challengers undecided, every `FOLLOW_UP_EVERY` iterations it starts the follow-up rounds (step 5
    of the module docstring), which hand it back when their pair of rounds is done.

    Args:
        trials: the trials that kept the plan (run again from the start).
        result: what they decided (the report's, until a follow-up decides).
        follow_up: the next follow-up rounds, or None.
    """

    def __init__(self, trials: PlanTrials, result: TrialResult, follow_up: PlanTrials | None = None):
        self.trials = trials
        self.result = result
        self.follow_up = follow_up
        self.window: list[float] = []
        self.seen = 0
        self.slow_windows = 0
        self.slowest = PendingReduction(trials.watch_reduction)

    def continued(self, follow_up: PlanTrials | None, result: TrialResult | None = None) -> "ChoiceWatch":
        """This watch after follow-up rounds, its windows started afresh.

        Args:
            follow_up: the next follow-up rounds, or None.
            result: the decision the follow-up rounds took, if any (else the report and the watch
                keep the earlier one).
        """
        self.follow_up, self.slow_windows, self.window = follow_up, 0, []
        self.result = result or self.result
        return self

    @property
    def reference(self) -> float:
        """The kept plan's median visit time in the trials or the fastest other plan's, whichever
        is slower: a window's lower quartile past it by `RETRIAL_DRIFT` is slow."""
        seconds, kept = self.result.seconds, self.result.verdict.kept
        others = [time for index, time in enumerate(seconds) if index != kept]
        return max(seconds[kept], min(others, default=0.0))

    def observe(self, done: IterationDone) -> PlanTrials | None:
        """After an iteration under the kept plan: the trials to run again, the follow-up rounds to
        run now, or None."""
        self.seen += 1
        again = self._judge_window()
        if again is not None:
            return again
        if not done.skipped:
            self.window.append(done.stats.iteration_time)
        if len(self.window) >= WATCH_WINDOW:
            self.slowest.start([statistics.quantiles(self.window, n=4)[0]])
            self.window = []
        if self.follow_up is not None and self.seen % FOLLOW_UP_EVERY == 0:
            follow_up, self.follow_up = self.follow_up, None
            follow_up.handed_over(self)
            return follow_up
        return None

    def _judge_window(self) -> PlanTrials | None:
        """The last window's slowest lower quartile against ``reference``: the trials again, or None."""
        slowest = self.slowest.take()
        if slowest is None:
            return None
        slowest, channels, reference = slowest[0], self.trials.channels, self.reference
        self.slow_windows = self.slow_windows + 1 if slowest > reference * (1 + RETRIAL_DRIFT) else 0
        if self.slow_windows >= 2 and self.seen >= RETRIAL_COOLDOWN:
            if channels.rank == 0:
                log.info("gradsync auto: the kept plan runs %.0f%% slower than it and every other plan ran in its "
                         "trials: timing the plans again", 100 * (slowest / reference - 1))
            return self.trials.again()
        return None

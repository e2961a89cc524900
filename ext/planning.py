"""The planning pipeline: a bound planner and a codec give one plan per wire layout, each made on
the sizes that travel, and the simulator predicts the time of a step's rounds."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .compress.codec import Codec
from .compress.wire import codec_seconds, wire_profile
from .cost import CostModel
from .plan import ALLREDUCE, Plan
from .planners import BoundPlanner, chosen_label
from .profile import LayerProfile, ModelProfile
from .simulate import simulate


@dataclass(frozen=True)
class LayoutPlan:
    plan: Plan
    wire: ModelProfile  # the profile the plan was made on
    # the codec's modelled encode and decode of the whole layout (from FLOP/s; 0 for a measured
    # profile, whose serial codec work is in its update time): what a later round adds serially
    codec_seconds: tuple[float, float] = (0.0, 0.0)


def plan_layouts(profile: ModelProfile, cost: CostModel, planner: BoundPlanner, codec: Codec,
                 flops_per_second: float | None = None, collective: str = ALLREDUCE) -> dict[str, LayoutPlan]:
    """The planner's plan of every layout of `codec`, each made on that layout's wire profile with
    the planner's byte thresholds scaled by the layout's compression rate, its ops `collective`s
    planned with that collective's cost (``CostModel.for_collective``).

    Args:
        profile: the model's uncompressed profile.
        cost: the all-reduce cost model.
        planner: the bound planner.
        codec: the compressor, set up on the profile's tensors.
        flops_per_second: models the codec's encoding and decoding time (None: a measured
            profile, whose serial codec work is in its update time).
        collective: ``allreduce``, or ``reduce_scatter`` where each rank needs only its partition.
    """
    tensors = [spec for layer in profile.layers for spec in layer.tensors]
    result = {}
    for layout in codec.layouts():
        wire = wire_profile(profile, codec, layout, flops_per_second)
        scaled = planner.scaled(wire.total_bytes / profile.total_bytes)
        plan = scaled(wire, cost.for_collective(collective)).with_collective(collective).validate(wire)
        labelled = tuple(replace(op, codec=codec.name) for op in plan.ops)
        result[layout] = LayoutPlan(Plan(labelled, plan.planner, plan.options), wire,
                                    codec_seconds(tensors, codec, layout, flops_per_second))
    return result


def at_compute_scale(layout_plans: dict[str, LayoutPlan], scale: float) -> dict[str, LayoutPlan]:
    """The same plans, with their wire profiles' times multiplied by `scale` (a computation
    `scale` times slower than when profiled: gradsync.runtime.compute_speed)."""
    return {layout: replace(entry, wire=entry.wire.scaled(scale),
                            codec_seconds=tuple(seconds * scale for seconds in entry.codec_seconds))
            for layout, entry in layout_plans.items()}


@dataclass(frozen=True)
class StepPrediction:
    """A step's predicted iteration time and the computing thread's busy time in it (seconds)."""

    time: float
    busy: float


def step_prediction(layout_plans: dict[str, LayoutPlan], rounds: tuple[str, ...], cost: CostModel) -> StepPrediction:
    """Predicted time of a step sending `rounds`. One round: the simulator's. A later round starts
    once the one before is reduced and decoded, and its own encoding is done (the computing thread's
    serial work, `codec_seconds`), so its all-reduces follow the first round's end, before the next
    forward (timed by simulating its plan with all gradients ready at once); the thread then waits.

    Args:
        layout_plans: the plan of every wire layout (``plan_layouts``).
        rounds: the layouts the step sends, in order (``Codec.rounds``).
        cost: the all-reduce cost model.
    """
    first = layout_plans[rounds[0]]
    timeline = simulate(first.plan, first.wire, cost)
    if len(rounds) == 1:
        return StepPrediction(timeline.iteration_time, timeline.busy_time)
    clock, serial = max(timeline.backward_end, timeline.comm_end), 0.0
    for previous, layout in zip(rounds, rounds[1:]):
        later = layout_plans[layout]
        work = layout_plans[previous].codec_seconds[1] + later.codec_seconds[0]
        at_once = ModelProfile(later.wire.name, tuple(LayerProfile(l.name, l.tensors, 0.0, 0.0)
                                                      for l in later.wire.layers))
        clock += work + simulate(later.plan, at_once, cost).comm_end
        serial += work
    last = layout_plans[rounds[-1]].wire
    tail = last.update_time + last.forward_time  # the last round's decoding is in its forward time
    return StepPrediction(clock + tail, timeline.backward_busy + serial + tail)


def predict_step(layout_plans: dict[str, LayoutPlan], rounds: tuple[str, ...], cost: CostModel) -> float:
    """Predicted iteration time of a step sending `rounds`.

    Args:
        layout_plans, rounds, cost: as ``step_prediction``.
    """
    return step_prediction(layout_plans, rounds, cost).time


def predict_steady(layout_plans: dict[str, LayoutPlan], cycle: list[tuple[str, ...]], cost: CostModel) -> float:
    """The mean predicted step time over a codec's steady cycle of steps.

    Args:
        layout_plans, cost: as ``step_prediction``.
        cycle: each step's rounds over the cycle (``Codec.steady_rounds``).
    """
    return sum(predict_step(layout_plans, rounds, cost) for rounds in cycle) / len(cycle)


def predict_cycle(profile: ModelProfile, cost: CostModel, planner: BoundPlanner, codec: Codec,
                  flops_per_second: float | None = None,
                  collective: str = ALLREDUCE) -> tuple[dict[str, LayoutPlan], float]:
    """The plans of every layout and the mean predicted step time over the codec's steady cycle
    (e.g. ACP-SGD's P step and Q step).

    Args:
        profile, cost, planner, codec, flops_per_second, collective: as ``plan_layouts``.
    """
    layout_plans = plan_layouts(profile, cost, planner, codec, flops_per_second, collective)
    return layout_plans, predict_steady(layout_plans, codec.steady_rounds(), cost)


# auto's trials time no candidate predicted slower than this many times its own choice (or the
# baseline, whichever is predicted faster). The simulator has erred by up to 50% on a plan of many
# small ops (wfbp on the emulated ResNet-50), less on plans of few; a plan predicted twice as slow
# would need more than that to win, and its trial iterations would be lost training time (on the
# emulated MobileNet-V2 at 8 ranks, bytescheduler, us_byte and wfbp ran 12-20x DDP's buckets' time).
TRIAL_PREDICTION_LIMIT = 2.0


@dataclass(frozen=True)
class Alternative:
    """A plan worth timing: the bound planner, the planner(s) its steady plans come from
    (``chosen_label``) and its mean predicted step time over the codec's steady cycle."""

    planner: BoundPlanner
    label: str
    predicted: float


def plan_alternatives(profile: ModelProfile, cost: CostModel, codec: Codec, planner: BoundPlanner,
                      count: int, collective: str = ALLREDUCE,
                      incumbent: BoundPlanner | None = None) -> list[Alternative]:
    """Up to `count` versions of a planner that chooses among others (``auto``) worth timing: first
    its baseline (``BoundPlanner.baseline``: torch DDP's buckets) when its candidates include one,
    then the planner itself (its own choice), then the planner restricted to each other candidate,
    best predicted cycle time first, as long as its prediction is within ``TRIAL_PREDICTION_LIMIT``
    times the best of the first two; given an `incumbent`, that planner and the planner itself
    alone. Any whose steady layouts' plans equal those of one already listed is skipped.

    Args:
        profile, cost: what the plans are made on.
        codec: the compressor, set up on the profile's tensors.
        planner: a bound planner that chooses (``BoundPlanner.chooses``).
        count: the most alternatives returned.
        collective: the plans' ops' (``plan_layouts``).
        incumbent: the planner whose plans run now, kept unless another is faster (re-planning).
    """
    def alternative(bound: BoundPlanner) -> tuple[Alternative, tuple[str, ...]]:
        layout_plans, predicted = predict_cycle(profile, cost, bound, codec, collective=collective)
        steady = [layout_plans[layout].plan for layout in steady_layouts(codec)]
        return Alternative(bound, chosen_label(steady), predicted), tuple(plan.hash for plan in steady)

    baseline = incumbent or planner.baseline()
    first = [alternative(baseline)] if baseline is not None else []
    first.append(alternative(planner))
    ranked = [] if incumbent is not None else sorted(
        (alternative(single) for single in planner.alternatives() if single != baseline),
        key=lambda item: (item[0].predicted, item[0].planner.described()))
    slowest = TRIAL_PREDICTION_LIMIT * min(single.predicted for single, _ in first)
    ranked = [(single, hashes) for single, hashes in ranked if single.predicted <= slowest]
    alternatives, seen = [], set()
    for single, hashes in [*first, *ranked]:
        if len(alternatives) >= count:
            break
        if hashes not in seen:
            seen.add(hashes)
            alternatives.append(single)
    return alternatives


def steady_layouts(codec: Codec) -> list[str]:
    """The layouts the codec sends once warmed up, in sending order (ACP-SGD: P then Q, not the
    uncompressed one)."""
    return list(dict.fromkeys(layout for rounds in codec.steady_rounds() for layout in rounds))

"""auto's plan trials: the plans worth comparing are timed on the live job; torch DDP's buckets
are kept unless another plan is faster with confidence, and the choice is checked afterwards."""
import copy
import logging
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync import compress, planners
from gradsync.cost import CostModel
from gradsync.launch import run_local
from gradsync.planning import TRIAL_PREDICTION_LIMIT, Alternative, plan_alternatives, predict_cycle
from gradsync.profile import zoo
from gradsync.runtime import attached
from gradsync.runtime import installed as installed_module
from gradsync.runtime.measure import Install, TrialsDone
from gradsync.runtime.measure import cost_watch as cost_watch_module
from gradsync.runtime.measure import trials as trials_module
from gradsync.runtime.measure.trials import (FOLLOW_UP_EVERY, MAX_FOLLOW_UP_ROUNDS, MAX_ROUNDS, MIN_ROUNDS, PlanTrials,
                                             judge, steady_rounds)
from gradsync.runtime.over_ranks import on_this_rank
from runtime_models import TiedNet, batch

CONFIDENCE, TOLERANCE = 0.95, 0.02


def sequential_verdict(truth: list[float], noise: float, rng: random.Random, budget: int = 16):
    """Rounds of visit times drawn around `truth` (log-normal, `noise` relative spread), judged
    after each round as the trials do, the last look at round `budget`."""
    rounds = []
    while True:
        rounds.append([seconds * math.exp(rng.gauss(0.0, noise)) for seconds in truth])
        verdict = judge(rounds, CONFIDENCE, TOLERANCE, last=len(rounds) >= budget)
        if verdict is not None:
            return verdict


@pytest.mark.parametrize("truth, noise, kept, at_least", [
    # a plan 8% faster than the baseline, visits 3% noisy: found at the stated confidence
    ([1.0, 0.92], 0.03, 1, 0.95),
    # the faster of two challengers (6% and 10%), found as often
    ([1.0, 0.94, 0.90], 0.03, 2, 0.90),
    # no real difference: the baseline kept at the stated confidence (over every look)
    ([1.0, 1.0], 0.03, 0, CONFIDENCE),
    ([1.0, 1.0, 1.0], 0.03, 0, CONFIDENCE),
    # slower challengers are never kept
    ([1.0, 1.1, 1.05], 0.03, 0, 1.0),
])
def test_trials_pick_a_faster_plan_at_the_stated_confidence_and_keep_ddp_within_noise(truth, noise, kept, at_least):
    rng = random.Random(7)
    runs = 400
    verdicts = [sequential_verdict(truth, noise, rng) for _ in range(runs)]
    share = sum(verdict.kept == kept for verdict in verdicts) / runs
    assert share >= at_least - 2 * math.sqrt(at_least * (1 - at_least) / runs)  # two standard errors


def kept_after_follow_ups(truth: list[float], noise: float, rng: random.Random, follow_up: bool) -> int:
    """sequential_verdict's trials, then (`follow_up`) pairs of follow-up rounds of the baseline and
    the challengers they left undecided, as ChoiceWatch runs them: the alternative kept at the end."""
    columns, rounds = list(range(len(truth))), []

    def draw():
        return [truth[column] * math.exp(rng.gauss(0.0, noise)) for column in columns]

    verdict = None
    while verdict is None:
        rounds.append(draw())
        verdict = judge(rounds, CONFIDENCE, TOLERANCE, last=len(rounds) >= MAX_ROUNDS)
    if not (follow_up and verdict.kept == 0 and verdict.undecided):
        return verdict.kept
    kept_columns = (0, *verdict.undecided)
    columns, rounds = [columns[index] for index in kept_columns], [[r[i] for i in kept_columns] for r in rounds]
    verdict = None
    while verdict is None:
        rounds += [draw(), draw()]
        verdict = judge(rounds, CONFIDENCE, TOLERANCE, last=len(rounds) >= MAX_FOLLOW_UP_ROUNDS)
    return columns[verdict.kept]


@pytest.mark.parametrize("truth, kept, alone_below, at_least", [
    # 3% faster in visits 5% noisy: the trials alone find it in about a third of the runs, the
    # follow-up rounds in most
    ([1.0, 0.97], 1, 0.5, 0.85),
    # no real difference: the baseline kept at the stated confidence over every look, follow-ups included
    ([1.0, 1.0], 0, 1.01, CONFIDENCE),
    ([1.0, 1.0, 1.0], 0, 1.01, CONFIDENCE),
    ([1.0, 1.03], 0, 1.01, 1.0),  # a slower challenger is dropped, never kept
])
def test_follow_up_rounds_find_a_small_gain_the_trials_alone_miss_and_keep_ddp_within_noise(truth, kept, alone_below,
                                                                                             at_least):
    runs = 400
    shares = {}
    for follow_up in (False, True):
        rng = random.Random(7)
        shares[follow_up] = sum(kept_after_follow_ups(truth, 0.05, rng, follow_up) == kept for _ in range(runs)) / runs
    assert shares[False] < alone_below
    assert shares[True] >= at_least - 2 * math.sqrt(at_least * (1 - at_least) / runs)  # two standard errors


def test_judge_waits_for_three_rounds_then_stops_on_clear_evidence():
    rounds = [[1.0, 0.8], [1.01, 0.81], [0.99, 0.79], [1.0, 0.8], [1.0, 0.8]]
    assert judge(rounds[:MIN_ROUNDS - 1], CONFIDENCE, TOLERANCE, last=False) is None
    assert judge(rounds, CONFIDENCE, TOLERANCE, last=False) is None  # looks come after pairs of rounds
    verdict = judge(rounds[:MIN_ROUNDS], CONFIDENCE, TOLERANCE, last=False)
    assert verdict.kept == 1 and verdict.settled and verdict.rounds == MIN_ROUNDS
    assert verdict.gains[1] == pytest.approx(1.0 / 0.8 - 1, rel=0.02)
    # equal times: the challenger cannot be worth the change; the baseline kept, settled
    equal = judge([[1.0, 1.0]] * MIN_ROUNDS, CONFIDENCE, TOLERANCE, last=False)
    assert equal.kept == 0 and equal.settled
    # undecided evidence waits for more rounds, and the last look keeps the baseline, unsettled
    noisy = [[1.0, 0.97], [1.0, 1.03], [1.0, 0.96], [1.0, 1.04]]
    assert judge(noisy, CONFIDENCE, TOLERANCE, last=False) is None
    ended = judge(noisy, CONFIDENCE, TOLERANCE, last=True)
    assert ended.kept == 0 and not ended.settled


def test_a_burst_of_host_load_is_set_aside_once_the_pairs_around_it_outnumber_it():
    rng = random.Random(5)
    usual = [[1.0 * math.exp(rng.gauss(0, 0.02)), 0.97 * math.exp(rng.gauss(0, 0.02))] for _ in range(12)]
    burst = [[12.7, 3.7], [4.1, 10.9]]  # a pair of rounds 4-13x slower, its ratios far apart
    alone = judge(usual, CONFIDENCE, TOLERANCE, last=True)
    with_burst = judge(burst + usual, CONFIDENCE, TOLERANCE, last=True)
    assert with_burst.set_aside == 2 and alone.set_aside == 0 and with_burst.rounds == 14
    assert (with_burst.kept, with_burst.gains, with_burst.margins) == (alone.kept, alone.gains, alone.margins)
    assert alone.kept == 1  # 3% faster is found on the steady rounds
    # while the burst is most of the rounds, it is the host's usual speed: nothing is set aside
    assert judge(burst + usual[:2], CONFIDENCE, TOLERANCE, last=True).set_aside == 0
    assert steady_rounds(burst + usual) == usual
    # a host slowing by less than HOST_BURST keeps every round
    assert steady_rounds([[visit * (1 + 0.05 * i) for visit in visits] for i, visits in enumerate(usual)]) == [
        [visit * (1 + 0.05 * i) for visit in visits] for i, visits in enumerate(usual)]
    summary = trials_module.TrialResult(("ddp", "mg_wfbp"), (1.0, 0.97), (1.0, 0.98), with_burst, 200).summary()
    assert "(14 rounds, 2 set aside as bursts of host load, 200 iterations;" in summary


def scripted_trials(seconds: dict, drift: float, confidence: float = CONFIDENCE):
    """PlanTrials on a scripted job whose plan `name` takes `seconds[name]`, times (1 + `drift`) more
    at every iteration (the host slowing down steadily); a plan is named by its planner's candidate."""
    clock = {"now": 0.0}
    trials_module.now = lambda device: clock["now"]
    auto = planners.bind("auto", confidence=confidence, trial_seconds=1000.0)
    alternatives = [Alternative(auto.with_options(candidates=(name,)), name, seconds[name]) for name in seconds]
    channels = SimpleNamespace(process_group=None, timeout=60.0, rank=0)
    trials = PlanTrials(None, alternatives, 2, auto, channels, torch.device("cpu"), on_this_rank)

    def name_of(planner):
        return next(alternative.label for alternative in alternatives if alternative.planner == planner)

    return trials, clock, name_of


def captured_log() -> list[str]:
    """The messages the gradsync logger emits at INFO and above from now on, as a list that fills."""
    logged = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("gradsync").addHandler(handler)
    logging.getLogger("gradsync").setLevel(logging.INFO)
    return logged


def trials_under_drift(rank, world_size, seconds: dict, drift: float):
    """What the scripted trials installed, timed, kept and logged."""
    logged = captured_log()
    trials, clock, name_of = scripted_trials(seconds, drift)
    installed = [name_of(trials.first.planner)]
    done = SimpleNamespace(skipped=False)
    for iteration in range(1000):
        clock["now"] += seconds[installed[-1]] * (1 + drift * iteration)
        request = trials.iteration_done(done)
        if request is not None and request.planner is not None:
            installed.append(name_of(request.planner))
        if isinstance(request, TrialsDone):
            return {"installed": installed, "result": request.result, "iterations": iteration + 1,
                    "kept_by_request": None if request.planner is None else name_of(request.planner),
                    "logged": logged}
    raise AssertionError("the trials did not end")


def test_trials_visit_plans_forth_and_back_so_a_drifting_host_ranks_them_right():
    # The host slows by 0.4% per iteration: timed one plan after the other, ddp (visited first)
    # would look fastest. Visited forth then back, paired within each round, the drift cancels
    # and mg_wfbp, truly 10% faster than ddp, is kept.
    seconds = {"ddp": 1.00, "wfbp": 0.97, "mg_wfbp": 0.90}
    result = run_local(trials_under_drift, 1, seconds, 0.004, timeout=120)[0]
    trial = result["result"]
    # round 1: ddp wfbp mg_wfbp; round 2 goes on with mg_wfbp (no switch), then wfbp, ddp; round 3 ...
    assert result["installed"][:7] == ["ddp", "wfbp", "mg_wfbp", "wfbp", "ddp", "wfbp", "mg_wfbp"]
    # a settling iteration after each switch (and at the start): 3 x 3 in the first round, 2 + 2 x 3 after
    assert result["iterations"] == trial.iterations == 9 + 8 * (trial.verdict.rounds - 1)
    assert trial.verdict.rounds % 2 == 0
    assert trial.labels == ("ddp", "wfbp", "mg_wfbp") and trial.kept == "mg_wfbp" and trial.verdict.settled
    assert trial.verdict.gains[2] == pytest.approx(1 / 0.9 - 1, abs=0.01)
    assert trial.verdict.gains[1] == pytest.approx(1 / 0.97 - 1, abs=0.01)
    installed_last = result["installed"][-2] if result["kept_by_request"] else result["installed"][-1]
    assert (result["kept_by_request"] or installed_last) == "mg_wfbp"
    assert "kept mg_wfbp: faster than ddp with confidence" in trial.summary()
    assert result["logged"] == [f"gradsync auto: {trial.summary()}"]


# a link of high latency (12 ms an op, as the emulated 8-rank ring measures): plans of many small
# ops are predicted several times slower than DDP's buckets
HIGH_LATENCY = CostModel(a=12e-3, b=8 / 0.5e9, gamma=2.0, host=0.6e-3)


@pytest.mark.parametrize("model, cost, compressor, steady, count", [
    ("resnet50", CostModel.preset("asc-wfbp-10gbe", 8), None, ("plain",), 4),
    ("resnet50", CostModel.preset("asc-wfbp-10gbe", 8), {"type": "acp_sgd", "rank": 4, "start_iter": 2},
     ("P", "Q"), 4),
    ("mobilenet_v2", HIGH_LATENCY, None, ("plain",), 2)])
def test_alternatives_are_ddp_then_auto_then_the_best_predicted_distinct_plans(model, cost, compressor, steady,
                                                                               count):
    profile = zoo(model)
    codec = compress.build(compressor)
    codec.setup({t.name: t for layer in profile.layers for t in layer.tensors}, 8, seed=0)
    auto = planners.bind("auto")
    alternatives = plan_alternatives(profile, cost, codec, auto, 4)
    assert len(alternatives) == count
    # brute force: every candidate's predicted cycle and the plans it runs once warmed up (the
    # uncompressed warm-up layout does not make two plans different)
    pool = [name for name in planners.names() if name != "auto"]
    outcomes = {}
    for name in pool:
        plans, seconds = predict_cycle(profile, cost, planners.bind("auto", candidates=(name,)), codec)
        outcomes[name] = (seconds, tuple(plans[layout].plan.hash for layout in steady))
    own = tuple(predict_cycle(profile, cost, auto, codec)[0][layout].plan.hash for layout in steady)
    expected, seen = [planners.bind("auto", candidates=("ddp",))], {outcomes["ddp"][1]}
    if own not in seen:
        expected.append(auto)
        seen.add(own)
    # candidates predicted more than TRIAL_PREDICTION_LIMIT times the faster of the first two are not timed
    slowest = TRIAL_PREDICTION_LIMIT * min(outcomes["ddp"][0], predict_cycle(profile, cost, auto, codec)[1])
    too_slow = {name for name in pool if outcomes[name][0] > slowest and outcomes[name][1] not in seen}
    assert bool(too_slow) == (model == "mobilenet_v2")  # the limit is what leaves the last case short of 4
    for name in sorted(set(pool) - too_slow, key=lambda n: (outcomes[n][0], n)):
        if outcomes[name][1] not in seen and len(expected) < 4:
            seen.add(outcomes[name][1])
            expected.append(planners.bind("auto", candidates=(name,)))
    assert [alternative.planner for alternative in alternatives] == expected
    assert alternatives[0].label == "ddp"
    for alternative in alternatives:
        assert alternative.predicted == pytest.approx(predict_cycle(profile, cost, alternative.planner, codec)[1])


def test_without_a_candidate_worth_timing_auto_keeps_its_plan_and_says_why(caplog):
    profile = zoo("mobilenet_v2")
    codec = compress.build(None)
    codec.setup({t.name: t for layer in profile.layers for t in layer.tensors}, 8, seed=0)
    auto = planners.bind("auto", candidates=("ddp", "wfbp", "bytescheduler"))
    # the per-tensor plans, predicted several times DDP's buckets' time on the high-latency link
    assert min(predict_cycle(profile, HIGH_LATENCY, planners.bind("auto", candidates=(name,)), codec)[1]
               for name in ("wfbp", "bytescheduler")) > TRIAL_PREDICTION_LIMIT * predict_cycle(
                   profile, HIGH_LATENCY, auto, codec)[1]
    caplog.set_level(logging.INFO, logger="gradsync")
    channels = SimpleNamespace(process_group=None, timeout=60.0, rank=0)
    assert PlanTrials.start(profile, HIGH_LATENCY, codec, auto, 4, channels, torch.device("cpu"), on_this_rank) is None
    assert caplog.messages == ["gradsync auto: kept ddp without plan trials: no other candidate makes other plans "
                               f"predicted within {TRIAL_PREDICTION_LIMIT:g}x its time"]


def test_without_ddp_among_the_candidates_auto_own_choice_comes_first():
    profile = zoo("resnet50")
    cost = CostModel.preset("asc-wfbp-10gbe", 8)
    codec = compress.build(None)
    codec.setup({t.name: t for layer in profile.layers for t in layer.tensors}, 8, seed=0)
    auto = planners.bind("auto", candidates=("wfbp", "mg_wfbp"))
    alternatives = plan_alternatives(profile, cost, codec, auto, 3)
    assert alternatives[0].planner == auto and auto.baseline() is None


def test_after_a_replanning_the_incumbent_is_the_baseline_and_the_new_choice_its_only_challenger():
    profile = zoo("resnet50")
    codec = compress.build(None)
    codec.setup({t.name: t for layer in profile.layers for t in layer.tensors}, 8, seed=0)
    auto = planners.bind("auto")
    slower_link = CostModel.preset("asc-wfbp-10gbe", 8).rescaled_b(4.0)
    incumbent = planners.bind("auto", candidates=("wfbp",))  # what ran before the link slowed
    alternatives = plan_alternatives(profile, slower_link, codec, auto, 4, incumbent=incumbent)
    assert [alternative.planner for alternative in alternatives] == [incumbent, auto]
    # the incumbent's plans on the new cost, predicted as any other
    assert alternatives[0].predicted == pytest.approx(predict_cycle(profile, slower_link, incumbent, codec)[1])
    # an incumbent that makes auto's own plans leaves nothing to time
    assert len(plan_alternatives(profile, slower_link, codec, auto, 4, incumbent=auto)) == 1


def train_side_by_side(rank: int, steps: int, pairs, schedulers=()) -> None:
    """`steps` steps of TiedNet's task for each (model, optimizer) of `pairs` in turn, then the
    LR `schedulers`."""
    for step in range(steps):
        for net, opt in pairs:
            opt.zero_grad()
            tokens, targets = batch(rank, step)
            F.cross_entropy(net(tokens, use_rank0_branch=rank == 0), targets).backward()
            opt.step()
        for scheduler in schedulers:
            scheduler.step()


def training_with_trials(rank, world_size):
    """60 steps of auto with a measured profile and plan trials (AdamW, LR schedule), beside DDP,
    on a cost of next to no latency: every candidate's plan predicted within TRIAL_PREDICTION_LIMIT
    of the others (on the loopback's measured latency, wfbp's per-tensor ops are not worth timing)."""
    torch.manual_seed(3)
    model = TiedNet()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    make = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    model, optimizer = gradsync.wrap(model, make(model.parameters()), scheduler="auto", cost=CostModel(1e-6, 1e-10),
                                     candidates=("wfbp", "ddp", "us_byte"), plan_trials=3, trial_seconds=0.1)
    ref_optimizer = make(reference.parameters())
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=8, gamma=0.7) for o in (optimizer, ref_optimizer)]
    train_side_by_side(rank, 60, ((model, optimizer), (reference, ref_optimizer)), schedulers)
    optimizer.synchronize()
    sync = attached(model)
    error = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    report = gradsync.report(model)
    result = {"error": error, "trials": report.trials, "chosen": report.chosen, "measuring": report.measuring}
    sync.detach()
    return result


def test_trials_time_each_plan_keep_one_and_train_like_ddp():
    results = run_local(training_with_trials, 2, timeout=300)
    trials = results[0]["trials"]
    assert trials is not None and results[1]["trials"] == trials  # one decision on every rank
    assert trials.labels[0] == "ddp"  # the baseline first
    assert len(trials.labels) >= 2 and len(set(trials.labels)) == len(trials.labels)
    assert set(trials.labels) <= {"wfbp", "ddp", "us_byte"}
    assert trials.verdict.rounds >= MIN_ROUNDS and trials.verdict.rounds % 2 == 0
    for result in results:
        assert result["chosen"] == trials.kept
        assert not result["measuring"]
        assert result["error"] < 1e-5


def watched(rank, world_size, times: list[float], cooldown: int, trial_times: tuple[float, float]):
    """ChoiceWatch over scripted iteration times, after trials that timed ddp and us_byte at
    `trial_times` and kept ddp: the iterations after which it started the trials again."""
    trials_module.RETRIAL_COOLDOWN = cooldown
    trials, _, name_of = scripted_trials(dict(zip(("ddp", "us_byte"), trial_times)), 0.0)
    verdict = trials_module.Verdict(0, True, (0.0, 0.0), (0.0, 0.0), MIN_ROUNDS)
    result = trials_module.TrialResult(("ddp", "us_byte"), trial_times, trial_times, verdict, 10)
    watch = trials_module.ChoiceWatch(trials, result)
    restarts = []
    for iteration, seconds in enumerate(times):
        again = watch.observe(SimpleNamespace(skipped=False, stats=SimpleNamespace(iteration_time=seconds)))
        if again is not None:
            restarts.append((iteration + 1, name_of(again.first.planner), len(again.rounds)))
            watch = trials_module.ChoiceWatch(trials, result)
    return restarts


@pytest.mark.parametrize("times, cooldown, trial_times, restarts", [
    ([1.05] * 96, 0, (1.0, 0.9), []),  # within RETRIAL_DRIFT of the kept plan's trial time
    ([1.05] * 32 + [1.2] * 16 + [1.0] * 16 + [1.2] * 16, 0, (1.0, 0.9), []),  # slower in one window, not two running
    # two slow windows: the trials again, from the baseline, at the iteration after the second
    # (a window's reduction over the ranks is read at the next iteration)
    ([1.0] * 32 + [1.2] * 33, 0, (1.0, 0.9), [(65, "ddp", 0)]),
    ([1.2] * 64, 48, (1.0, 0.9), [(49, "ddp", 0)]),  # not before the cool-down
    # every other iteration stalled: the median is 30% slower, the lower quartile is not
    ([1.0, 1.6] * 48, 0, (1.0, 0.9), []),
    # the other plan ran 1.3 s in the trials: the kept plan is slow once it runs slower than that
    ([1.2] * 64, 0, (1.0, 1.3), []),
    ([1.5] * 64, 0, (1.0, 1.3), [(33, "ddp", 0)]),
])
def test_the_choice_is_checked_and_the_trials_run_again_when_the_kept_plan_slows(times, cooldown, trial_times,
                                                                                  restarts):
    assert run_local(watched, 1, times, cooldown, trial_times, timeout=120)[0] == restarts


def follow_ups_on_a_scripted_job(rank, world_size, seconds: dict, noise: float, seed: int):
    """The trials, then ChoiceWatch with its follow-up rounds, on a scripted job whose plan `name`
    takes `seconds[name]` times a log-normal factor (`noise`) per iteration, as the runtime drives
    them (``runtime.installed``), until 3 × FOLLOW_UP_EVERY iterations after the decision: per
    iteration the plan that ran, and what was decided when."""
    rng = random.Random(seed)
    logged = captured_log()
    trials, clock, name_of = scripted_trials(seconds, 0.0)
    installed, measurement, watch = name_of(trials.first.planner), trials, None
    ran, decisions, follow_ups, final = [], [], [], None
    for iteration in range(20 * MAX_FOLLOW_UP_ROUNDS * FOLLOW_UP_EVERY):
        if final is not None and iteration > final + 3 * FOLLOW_UP_EVERY:
            break
        elapsed = seconds[installed] * math.exp(rng.gauss(0.0, noise))
        clock["now"] += elapsed
        ran.append(installed)
        done = SimpleNamespace(skipped=False, stats=SimpleNamespace(iteration_time=elapsed))
        if measurement is None:
            again = watch.observe(done)
            if again is not None:
                follow_ups.append((iteration, name_of(again.first.planner), again.alternatives))
                measurement, watch = again, None
            continue
        request = measurement.iteration_done(done)
        if isinstance(request, Install):
            installed = name_of(request.planner)
        elif isinstance(request, TrialsDone):
            if request.planner is not None:
                installed = name_of(request.planner)
            measurement, watch = None, request.watch
            decisions.append((iteration, request.result))
            if request.watch.follow_up is None:  # decided: what runs after is checked for a while
                final = iteration
    return {"ran": ran, "decisions": decisions, "follow_ups": follow_ups, "logged": logged}


def test_follow_up_rounds_run_every_so_many_iterations_of_the_kept_plan_and_switch_when_one_wins():
    # mg_wfbp 3% faster than ddp, iterations 8% noisy: the trials' budget (16 rounds) runs out
    # undecided; follow-up rounds every FOLLOW_UP_EVERY iterations of ddp find mg_wfbp faster
    seconds = {"ddp": 1.0, "mg_wfbp": 0.97}
    result = run_local(follow_ups_on_a_scripted_job, 1, seconds, 0.08, 2, timeout=120)[0]
    decisions, follow_ups, ran = result["decisions"], result["follow_ups"], result["ran"]
    trials = decisions[0][1]
    assert trials.kept == "ddp" and not trials.verdict.settled and trials.follow_up_due
    assert trials.verdict.rounds == MAX_ROUNDS and trials.verdict.undecided == (1,)
    assert "the undecided ones are timed again every 64 iterations" in trials.summary()
    assert follow_ups, "no follow-up rounds ran"
    ends, starts = [at for at, _ in decisions], [at for at, _, _ in follow_ups]
    assert len(ends) == len(starts) + 1  # each follow-up hands the watch back once its pair of rounds is done
    for end, start in zip(ends, starts):  # FOLLOW_UP_EVERY iterations of the kept plan alone in between
        assert start - end == FOLLOW_UP_EVERY and set(ran[end + 1:start + 1]) == {"ddp"}
    for start, end, (_, first, alternatives) in zip(starts, ends[1:], follow_ups):
        # a pair of rounds, 2 timed iterations a visit: ddp (installed: no switch), mg_wfbp after a
        # settling iteration, mg_wfbp again (no switch), ddp after a settling iteration
        assert first == "ddp" and [a.label for a in alternatives] == ["ddp", "mg_wfbp"]
        assert ran[start + 1:end + 1] == ["ddp"] * 2 + ["mg_wfbp"] * 5 + ["ddp"] * 3
    final_iteration, final = decisions[-1]
    assert final.kept == "mg_wfbp" and final.verdict.settled
    # each visit timed from its own iterations alone, not the kept plan's in between
    assert final.seconds == pytest.approx((1.0, 0.97), rel=0.05)
    assert final.verdict.gains[1] == pytest.approx(0.03, abs=0.03)
    assert MAX_ROUNDS < final.verdict.rounds <= MAX_FOLLOW_UP_ROUNDS
    assert final.verdict.rounds == MAX_ROUNDS + 2 * len(follow_ups)  # the trials' rounds and two per follow-up
    assert set(ran[final_iteration + 1:]) == {"mg_wfbp"}  # switched, and no more follow-ups
    assert result["logged"][-1] == f"gradsync auto: follow-up rounds: {final.summary()}"
    assert "kept mg_wfbp: faster than ddp with confidence" in final.summary()


def scripted_judge(rounds, confidence, tolerance, last):
    """Every challenger undecided at the trials' last look (4 rounds) and after the first pair of
    follow-up rounds; the last challenger wins after the second."""
    count, looks = len(rounds[0]), len(rounds)
    if looks % 2 or looks < MIN_ROUNDS or looks == MIN_ROUNDS + 2:
        return None
    if looks == MIN_ROUNDS:
        return trials_module.Verdict(0, False, (0.0,) * count, (0.1,) * count, looks, tuple(range(1, count)))
    return trials_module.Verdict(count - 1, True, (0.0,) * (count - 1) + (0.05,), (0.01,) * count, looks)


def training_with_follow_ups(rank, world_size):
    """auto with scripted verdicts (scripted_judge) and follow-up rounds every 4 iterations, beside
    DDP, on a cost that predicts every candidate within TRIAL_PREDICTION_LIMIT of the others: the
    report and the log at the end, and the installations made before each hand-back of the host
    heap's free pages."""
    trials_module.judge, trials_module.FOLLOW_UP_EVERY = scripted_judge, 4
    logged = captured_log()
    installs, releases = [0], []
    install = installed_module.InstalledPlans.install

    def counted_install(self, *arguments):
        installs[0] += 1
        install(self, *arguments)

    installed_module.InstalledPlans.install = counted_install
    installed_module.release_freed_host_memory = lambda: releases.append(installs[0])
    torch.manual_seed(3)
    model = TiedNet()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     scheduler="auto", candidates=("wfbp", "ddp", "us_byte"), plan_trials=3,
                                     cost=CostModel(1e-6, 1e-10), warmup_iterations=1, measure_iterations=2)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    train_side_by_side(rank, 100, ((model, optimizer), (reference, ref_optimizer)))
    optimizer.synchronize()
    sync = attached(model)
    error = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    report = gradsync.report(model)
    result = {"error": error, "trials": report.trials, "chosen": report.chosen, "logged": logged,
              "follow_up_pending": sync.installed.following_up, "installs": installs[0], "releases": releases}
    sync.detach()
    return result


def test_follow_up_rounds_in_training_switch_every_rank_at_once_and_train_like_ddp():
    results = run_local(training_with_follow_ups, 2, timeout=300)
    trials = results[0]["trials"]
    assert trials == results[1]["trials"]  # one decision on every rank
    assert trials.labels[0] == "ddp" and trials.kept == trials.labels[-1] != "ddp"
    assert trials.verdict.rounds == MIN_ROUNDS + 4 and trials.verdict.settled  # two follow-ups of two rounds
    decisions = [line for line in results[0]["logged"] if line.startswith("gradsync auto:")]
    assert len(decisions) == 2 and "timed again every 4 iterations" in decisions[0]
    assert decisions[1] == f"gradsync auto: follow-up rounds: {trials.summary()}"
    for result in results:
        assert result["chosen"] == trials.kept and not result["follow_up_pending"]
        assert result["error"] < 1e-5
        # the heap's free pages go back after the wrap-time plan and the calibration, then not
        # until the choice settled: no hand-back among the installations of the trials and follow-ups
        assert result["installs"] > 4 and result["releases"] == [1, 1, result["installs"]]


def watchers_after_trials(rank, world_size, iterations: int):
    """auto's trials keep DDP's buckets at their first look (scripted), then the compute speed, the
    cost watch and auto's choice watch run for `iterations`: how many values each of their
    all-reduces over the ranks carried, in order. The cost watch never re-plans (a tiny model's
    communication on a busy host drifts past any threshold)."""
    def decided(rounds, confidence, tolerance, last):
        count = len(rounds[0])
        return None if len(rounds) < MIN_ROUNDS else trials_module.Verdict(0, True, (0.0,) * count, (0.0,) * count,
                                                                            len(rounds))
    trials_module.judge, cost_watch_module.DRIFT = decided, math.inf
    torch.manual_seed(3)
    model = TiedNet()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05), scheduler="auto",
                                     candidates=("wfbp", "ddp", "us_byte"), plan_trials=3,
                                     cost=CostModel(1e-6, 1e-10), warmup_iterations=1, measure_iterations=2)
    installed = attached(model).installed
    carried, start = [], installed.reductions.start_reduction

    def counted(values):
        carried.append(len(values))
        return start(values)
    installed.reductions.start_reduction = counted
    steps = 0
    while installed.following_up or installed.watch is None:
        train_side_by_side(rank, 1, ((model, optimizer),))
        steps += 1
        assert steps < 300, "the trials never ended"
    carried.clear()
    train_side_by_side(rank, iterations, ((model, optimizer),))
    assert installed.watch is not None and not installed.replans  # no other decision meanwhile
    attached(model).detach()
    return carried


def test_the_watchers_windows_close_together_and_travel_in_one_all_reduce():
    # after the trials' last iteration one settles, then the compute speed (1 value) and the cost
    # watch (1 layout and the iteration: 2 values) close a window every 8 iterations, the choice
    # watch (1 value) every 16: one all-reduce per 8 iterations, where there were 5 per 16
    carried = run_local(watchers_after_trials, 2, 1 + 48, timeout=300)
    assert carried[0] == carried[1] == [3, 4, 3, 4, 3, 4]


def test_the_summary_says_when_follow_ups_come_and_when_they_ended_undecided():
    def result(rounds, undecided, kept=0):
        verdict = trials_module.Verdict(kept, not undecided, (0.0, 0.01), (0.0, 0.02), rounds, undecided)
        return trials_module.TrialResult(("ddp", "mg_wfbp"), (1.0, 0.99), (1.0, 0.98), verdict, 100)

    due, ended, won = result(MAX_ROUNDS, (1,)), result(MAX_FOLLOW_UP_ROUNDS, (1,)), result(MAX_ROUNDS, (), kept=1)
    assert due.follow_up_due and "timed again every 64 iterations" in due.summary()
    assert not ended.follow_up_due
    assert f"no other plan found faster with confidence in {MAX_FOLLOW_UP_ROUNDS} rounds" in ended.summary()
    assert "the simulator predicts them within 2.0% of each other" in ended.summary()
    assert not won.follow_up_due and won.summary().startswith("kept mg_wfbp: faster than ddp with confidence")

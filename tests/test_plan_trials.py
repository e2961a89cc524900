"""auto's plan trials: the plans worth comparing are timed on the live job and the fastest kept."""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync import compress, planners
from gradsync.planning import Alternative, plan_alternatives, predict_cycle
from gradsync.cost import CostModel
from gradsync.launch import run_local
from gradsync.profile import zoo
from gradsync.runtime import attached
from gradsync.runtime.measure import TrialsDone
from gradsync.runtime.measure import trials as trials_module
from gradsync.runtime.measure.trials import PlanTrials, kept_trial, trial_order
from runtime_models import TiedNet, batch


@pytest.mark.parametrize("seconds, tolerance, kept", [
    ([1.0, 0.9, 0.95], 0.02, 1),  # the fastest, by more than the tolerance
    ([1.0, 0.99, 1.2], 0.02, 0),  # within the tolerance: auto's choice stays
    ([1.0, 0.97, 0.97], 0.02, 1),  # a tie: the earlier
    ([1.0, 0.99], 0.0, 1),
    ([0.5, 0.6, 0.7], 0.02, 0),
])
def test_kept_trial(seconds, tolerance, kept):
    assert kept_trial(seconds, tolerance) == kept


@pytest.mark.parametrize("count, rounds, order", [
    (3, 2, [0, 1, 2, 2, 1, 0]),
    (2, 3, [0, 1, 1, 0, 0, 1]),
    (2, 1, [0, 1]),
])
def test_trial_order_alternates_direction(count, rounds, order):
    assert trial_order(count, rounds) == order


def trials_under_drift(rank, world_size, seconds: dict, drift: float):
    """PlanTrials on a scripted job whose plan `name` takes `seconds[name]` plus `drift` more at
    every iteration (the host slowing down steadily); what was installed and timed. A plan is
    named by its planner's first candidate (auto's own choice, without candidates, is "auto's")."""
    clock = {"now": 0.0}
    trials_module.now = lambda device: clock["now"]
    names = list(seconds)
    alternatives = [Alternative(planners.bind("auto"), names[0], 0.0)]
    alternatives += [Alternative(planners.bind("auto", candidates=(name,)), name, 0.0) for name in names[1:]]
    group = SimpleNamespace(process_group=None, timeout=60.0)
    trials = PlanTrials(None, alternatives, 2, planners.bind("auto").tolerance, group, torch.device("cpu"))
    def name_of(planner):
        return next(alternative.label for alternative in alternatives if alternative.planner == planner)

    installed = [name_of(trials.first.planner)]
    done = SimpleNamespace(skipped=False)
    for iteration in range(100):
        clock["now"] += seconds[installed[-1]] + drift * iteration
        request = trials.iteration_done(done)
        if request is not None and request.planner is not None:
            installed.append(name_of(request.planner))
        if isinstance(request, TrialsDone):
            return {"installed": installed, "trials": request.times, "iterations": iteration + 1}
    raise AssertionError("the trials did not end")


def test_trials_visit_plans_both_ways_so_a_drifting_host_ranks_them_right():
    # Timed one plan after the other (3 iterations each), the slowdown of 0.02 s per iteration
    # would rank auto's choice first (1.04, 1.09, 1.10 s); visited A B C C B A, every plan's
    # samples sit at the same mean time, and C, truly the fastest, is kept.
    seconds = {"auto's": 1.00, "wfbp": 0.97, "mg_wfbp": 0.90}
    result = run_local(trials_under_drift, 1, seconds, 0.02, timeout=120)[0]
    # a settling iteration after each switch; the second visit of c follows the first directly
    assert result["iterations"] == 5 + 3 * 2 * 2
    assert result["installed"] == ["auto's", "wfbp", "mg_wfbp", "wfbp", "auto's", "mg_wfbp"]
    labels = [label for label, _ in result["trials"]]
    assert labels == list(seconds)
    for (label, median), truth in zip(result["trials"], seconds.values()):
        assert median == pytest.approx(truth + 0.02 * 8.5)


@pytest.mark.parametrize("compressor, steady", [(None, ("plain",)),
                                                ({"type": "acp_sgd", "rank": 4, "start_iter": 2}, ("P", "Q"))])
def test_alternatives_are_auto_then_the_best_predicted_distinct_plans(compressor, steady):
    profile = zoo("resnet50")
    cost = CostModel.preset("asc-wfbp-10gbe", 8)
    codec = compress.build(compressor)
    codec.setup({t.name: t for layer in profile.layers for t in layer.tensors}, 8, seed=0)
    alternatives = [alternative.planner for alternative in plan_alternatives(profile, cost, codec,
                                                                             planners.bind("auto"), 4)]
    assert alternatives[0] == planners.bind("auto") and len(alternatives) == 4
    # brute force: every candidate's predicted cycle and the plans it runs once warmed up (the
    # uncompressed warm-up layout does not make two plans different)
    pool = [name for name in planners.names() if name != "auto"]
    outcomes = {}
    for name in pool:
        plans, seconds = predict_cycle(profile, cost, planners.bind("auto", candidates=(name,)), codec)
        outcomes[name] = (seconds, tuple(plans[layout].plan.hash for layout in steady))
    plans = predict_cycle(profile, cost, planners.bind("auto"), codec)[0]
    expected, seen = [], {tuple(plans[layout].plan.hash for layout in steady)}
    for name in sorted(pool, key=lambda n: (outcomes[n][0], n)):
        if outcomes[name][1] not in seen and len(expected) < 3:
            seen.add(outcomes[name][1])
            expected.append(planners.bind("auto", candidates=(name,)))
    assert alternatives[1:] == expected


def training_with_trials(rank, world_size):
    """24 steps of auto with a measured profile and plan trials (AdamW, LR schedule), beside DDP."""
    torch.manual_seed(3)
    model = TiedNet()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    make = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    model, optimizer = gradsync.wrap(model, make(model.parameters()), scheduler="auto",
                                     candidates=("wfbp", "ddp", "us_byte"), plan_trials=3)
    ref_optimizer = make(reference.parameters())
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (optimizer, ref_optimizer)]
    for step in range(24):
        for net, opt in ((model, optimizer), (reference, ref_optimizer)):
            opt.zero_grad()
            tokens, targets = batch(rank, step)
            F.cross_entropy(net(tokens, use_rank0_branch=rank == 0), targets).backward()
            opt.step()
        for scheduler in schedulers:
            scheduler.step()
    optimizer.synchronize()
    sync = attached(model)
    error = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    result = {"error": error, "trials": sync.installed.trial_times, "chosen": sync.plan.options["chosen"],
              "measuring": sync.measurement is not None}
    sync.detach()
    return result


def test_trials_time_each_plan_keep_the_fastest_and_train_like_ddp():
    results = run_local(training_with_trials, 2, timeout=300)
    assert results[0]["trials"] == results[1]["trials"]  # one decision on every rank
    labels = [label for label, _ in results[0]["trials"]]
    seconds = [s for _, s in results[0]["trials"]]
    assert len(labels) >= 2 and len(set(labels)) == len(labels)
    assert set(labels) <= {"wfbp", "ddp", "us_byte"}
    for result in results:
        assert result["chosen"] == labels[kept_trial(seconds, 0.02)]
        assert not result["measuring"]
        assert result["error"] < 1e-5

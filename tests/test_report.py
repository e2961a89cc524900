"""gradsync.report(model): the read-only snapshot front-ends show, against the runtime and the
simulator computed independently."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync import planners, simulate
from gradsync.cost import CostModel
from gradsync.launch import run_local
from gradsync.runtime import attached
from runtime_models import TiedNet, batch


def reports_over_training(rank, world_size):
    """auto with ACP-SGD, profile measured, plan trials: the report while measuring and once settled,
    checked against the runtime's own state. The cost is given, of next to no latency: a cost measured
    on a busy host can predict every candidate but one past the trial limit, and then no trial runs."""
    torch.manual_seed(0)
    model = TiedNet()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                     compressor={"type": "acp_sgd", "rank": 2}, cost=CostModel(1e-6, 1e-10),
                                     warmup_iterations=1, measure_iterations=2, trial_seconds=0.2)
    sync = attached(model)
    early = gradsync.report(model)
    step = 0
    while gradsync.report(model).measuring:
        optimizer.zero_grad()
        tokens, targets = batch(rank, step)
        F.cross_entropy(model(tokens, use_rank0_branch=rank == 0), targets).backward()
        optimizer.step()
        step += 1
    settled = gradsync.report(model)
    try:
        settled.iteration = 0
        frozen = False
    except dataclasses.FrozenInstanceError:
        frozen = True
    timelines_match = all(entry.timeline.iteration_time == simulate(entry.plan, entry.wire, sync.installed.cost).iteration_time
                          for entry in settled.layouts.values())
    hashes_match = all(entry.plan.hash == sync.installed.plans[layout].hash for layout, entry in settled.layouts.items())
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    result = {
        "early": (early.measuring, early.iteration, early.latest, {e.plan.planner for e in early.layouts.values()}),
        "steps": step, "iteration": settled.iteration, "history": len(settled.history),
        "latest_is_last": settled.latest == sync.clock.history[-1],
        "steady_layouts": settled.steady_layouts, "steady": settled.steady.layout,
        "layouts": sorted(settled.layouts), "chosen": settled.chosen,
        "trials": settled.trials.labels if settled.trials else (), "kept": settled.trials and settled.trials.kept,
        "scheduler": settled.scheduler, "compressor": settled.compressor,
        "gradient_bytes": (settled.gradient_bytes, sum(p.numel() * p.element_size() for p in trainable.values())),
        "summary": settled.steady.summary(), "timelines_match": timelines_match, "hashes_match": hashes_match,
        "frozen": frozen,
    }
    sync.detach()
    return result


def test_the_report_follows_the_runtime_from_calibration_to_the_chosen_plan():
    for result in run_local(reports_over_training, 2):
        measuring, iteration, latest, early_planners = result["early"]
        assert (measuring, iteration, latest) == (True, 0, None)
        assert early_planners == {"ddp"}  # the calibration plan: one bucket
        assert result["iteration"] == result["history"] == result["steps"] > 3
        assert result["latest_is_last"] and result["frozen"]
        assert result["steady_layouts"] == ("P", "Q") and result["steady"] == "P"
        assert {"P", "Q"} <= set(result["layouts"])
        assert result["timelines_match"] and result["hashes_match"]
        names = set(planners.names())
        assert set(result["chosen"].split("/")) <= names
        assert len(result["trials"]) >= 2 and result["chosen"] == result["kept"] and result["trials"][0] == "ddp"
        assert (result["scheduler"], result["compressor"]) == ("auto {'trial_seconds': 0.2, 'channels': 2}", "acp_sgd")
        assert result["gradient_bytes"][0] == result["gradient_bytes"][1] > 0
        summary = result["summary"]
        assert summary["planner"] == "auto" and summary["chosen"] in names and summary["ops"] >= 1
        assert summary["predicted_ms"] > 0 and len(summary["hash"]) == 64


def test_report_of_a_model_not_wrapped_names_the_problem():
    with pytest.raises(gradsync.ConfigError, match="not wrapped"):
        gradsync.report(torch.nn.Linear(2, 2))

"""Predictions that follow the measured speed of the computation (gradsync.runtime.compute_speed)."""
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync import ConfigError
from gradsync.launch import run_local
from gradsync.runtime import attached
from gradsync.runtime.compute_speed import ComputeSpeed
from gradsync.runtime.parameter_table import ParameterTable
from runtime_models import COST


def test_the_scale_moves_by_the_windows_median_ratio_beyond_the_tolerance():
    speed = ComputeSpeed(window=3, tolerance=0.05)
    # the window's median ratio is reduced at the iteration that closes it and read at the next one
    assert [speed.observe(measured, 1.0) for measured in (2.0, 9.0, 1.8)] == [False, False, False]
    assert speed.ratios == [] and speed.scale == 1.0
    # the first window beyond the tolerance: the scale waits for a second one on the same side
    assert [speed.observe(measured, 1.0) for measured in (7.0, 2.0, 1.9)] == [False, False, False]
    assert speed.observe(1.0, 1.0) and speed.scale == 2.0  # the median: one disturbed iteration does not count
    assert speed.ratios == []  # that iteration was predicted at the old scale: left out...
    speed.observe(2.2, 2.0)
    assert speed.observe(2.0, 2.0) is False and speed.ratios == []  # ...of the ratios, not of the window's iterations
    # predictions made with the new scale: measured/predicted ratios near 1 keep it
    assert not any(speed.observe(measured, 2.0) for measured in (2.08, 2.0, 2.1, 2.0, 2.02, 1.98, 2.0))
    assert speed.scale == 2.0
    assert not speed.rescale(0.5) and speed.rescale(0.5) and speed.scale == 1.0
    # a prediction of nothing counts as on time
    speed = ComputeSpeed(window=3, tolerance=0.05)
    speed.observe(0.3, 0.0)
    assert speed.ratios == [1.0]


def test_a_ratio_that_moves_to_and_fro_keeps_the_scale():
    # a busy host's slowest rank: beyond the tolerance in every window, on alternate sides
    speed = ComputeSpeed(window=1, tolerance=0.03)
    assert not any(speed.rescale(ratio) for ratio in (1.07, 0.93, 1.06, 0.94, 1.05))
    assert speed.scale == 1.0
    # a window within the tolerance between two beyond it on the same side starts the count again
    speed = ComputeSpeed(window=1, tolerance=0.03)
    assert not any(speed.rescale(ratio) for ratio in (1.1, 1.01, 1.1)) and speed.scale == 1.0
    assert speed.rescale(1.1) and speed.scale == pytest.approx(1.1)
    assert ComputeSpeed(persist=1).rescale(1.1)  # persist=1: every window beyond it moves the scale


def test_the_slowest_ranks_ratio_scales_every_rank():
    started = []

    def slower_peer(values):  # another rank's window ran 3 times its prediction
        started.append(values)
        return lambda: [max(values[0], 3.0)]
    speed = ComputeSpeed(window=2, tolerance=0.05, start=slower_peer, persist=1)
    assert not speed.observe(1.0, 1.0) and not speed.observe(1.2, 1.0) and started == [[1.1]]
    assert speed.observe(1.0, 1.0) and speed.scale == 3.0


@pytest.mark.parametrize("window, tolerance, persist, message", [
    (0, 0.1, 2, "'window'"), (True, 0.1, 2, "'window'"), (2.5, 0.1, 2, "'window'"), (4, 1.0, 2, "'tolerance'"),
    (4, -0.1, 2, "'tolerance'"), (4, 0.1, 0, "'persist'"), (4, 0.1, True, "'persist'"), (4, 0.1, 1.5, "'persist'")])
def test_bad_settings_are_refused(window, tolerance, persist, message):
    with pytest.raises(ConfigError, match=message):
        ComputeSpeed(window, tolerance, persist=persist)


class PacedNet(nn.Module):
    """Two linear layers; the forward sleeps `pause` seconds (the computing thread's own time)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 4)
        self.pause = 0.0

    def forward(self, x):
        time.sleep(self.pause)
        return self.second(torch.relu(self.first(x)))


def paced_profile(model: PacedNet):
    """1 ms forward and 2 ms backward per layer: far from the paced model's real times."""
    table = ParameterTable.of(model)
    return table.profile("paced", ["first", "second"], {m: 1e-3 for m in table.owners},
                          {m: 2e-3 for m in table.owners})


def paced_training(rank, world_size, pauses):
    """Train with the given pauses per phase (one phase: 3 windows), rank 1's later pauses 3× longer;
    per phase: this rank's median measured busy time over its last window, the scale, the predicted
    busy time at that scale, the scale its last iteration recorded and the one it was predicted with
    (the window that ends with that iteration may rescale after it), and the plan's hash."""
    torch.manual_seed(0)
    model = PacedNet()
    wrapped, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                       profile=paced_profile(model), cost=COST)
    sync = attached(wrapped)
    window = sync.installed.speed.window
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=generator), torch.randint(0, 4, (4,), generator=generator)
    phases = []
    for phase, pause in enumerate(pauses):
        model.pause = pause * (3 if rank == 1 and phase > 0 else 1)
        for _ in range(3 * window):
            scale_of_this_prediction = sync.installed.speed.scale
            optimizer.zero_grad()
            F.cross_entropy(wrapped(x), y).backward()
            optimizer.step()
        recent = sorted(stats.busy_time for stats in list(sync.clock.history)[-window:])
        phases.append((recent[window // 2], sync.installed.speed.scale, sync.installed.prediction(sync.rounds_now).busy,
                       sync.clock.history[-1].compute_scale, scale_of_this_prediction, sync.plan.hash))
    sync.detach()
    return phases


def test_predictions_follow_the_slowest_ranks_measured_speed_and_the_plan_stays():
    results = run_local(paced_training, 2, [0.02, 0.02])
    (early0, late0), (early1, late1) = results
    # the first phase: both ranks pause 20 ms, and the made-up 9 ms profile is scaled up to it
    for busy, scale, predicted, recorded_scale, scale_of_that_prediction, _ in (early0, early1):
        assert busy > 0.02 and predicted == pytest.approx(busy, rel=0.25)
        assert scale > 2 and recorded_scale == scale_of_that_prediction > 2
    # the second phase: rank 1 pauses 60 ms; rank 0 waits for it in the all-reduce (not busy), and
    # both ranks predict rank 1's pace with one scale
    assert late0[1] == late1[1] and early0[1] == early1[1]
    assert late1[0] > 0.06 and late1[2] == pytest.approx(late1[0], rel=0.25)
    assert late0[0] < 0.5 * late1[0]
    assert 2 < late1[1] / early1[1] < 4.5
    # plans do not change with the predictions
    assert {phase[5] for phase in (early0, late0, early1, late1)} == {early0[5]}


def predictions_at_scales(rank, world_size, scales):
    """The prediction at each of `scales` (set as the compute speed's scale in turn), and how many
    simulations the predictions took in all."""
    from gradsync.runtime import installed as installed_module
    model = PacedNet()
    wrapped, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                       profile=paced_profile(model), cost=COST)
    sync = attached(wrapped)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    optimizer.zero_grad()
    F.cross_entropy(wrapped(x), y).backward()
    optimizer.step()
    simulated = []
    simulate = installed_module.step_prediction
    installed_module.step_prediction = lambda *args: simulated.append(args) or simulate(*args)
    try:
        predictions = []
        for scale in scales:
            sync.installed.speed.scale = scale
            predictions.append(sync.installed.prediction(sync.rounds_now).time)
    finally:
        installed_module.step_prediction = simulate
        sync.detach()
    return predictions, len(simulated)


def test_a_scale_that_returns_reuses_its_prediction():
    # a busy host's scale moves to and fro between windows: each scale is simulated once, and a
    # scale within its step (2%) of one simulated takes its prediction
    scales = [2.0, 1.5, 2.0, 1.5, 2.0 * 1.005, 2.0 * 1.05]
    (predictions, simulations), = run_local(predictions_at_scales, 1, scales)
    assert simulations == 3
    assert predictions[0] == predictions[2] == predictions[4] and predictions[1] == predictions[3]
    assert predictions[0] > predictions[1] and predictions[5] > predictions[0]

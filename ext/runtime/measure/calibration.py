"""The profile measured on the first iterations.

They run under the calibration plan (every gradient in one all-reduce when the backward pass
ends, ``planners.one_bucket``) while the layers are timed (``layers.LayerTimer``); the update time
is the engine's serial work outside the layers (buffer broadcast, optimizer step, a codec's
decoding and its later rounds' encoding). Layer times depend on what runs beside them (a codec's
encoding in the gradient hooks), so when some timed iterations were not in the codec's steady state,
as many steady ones are timed again. The host time of the calibration plan's op is taken out of the
layers' times. Every rank plans with rank 0's layers, each with its largest time over the ranks,
scaled to the slowest rank's totals (``layers.slowest_times``).
"""
from __future__ import annotations

from ...agreement import gather_from_all, waiting_for
from ...planners import one_bucket
from ...profile import ModelProfile
from ..channels import Channels
from ..parameter_table import ParameterTable
from . import Install, IterationDone, Measurement, ProfileMeasured, median
from .layers import LayerTimer, slowest_times, without_host


class ProfileCalibration(Measurement):
    """Skips `warmup` iterations, then times the layers over `iterations` ones and returns the
    profile (``ProfileMeasured``). When some timed iterations were not in the codec's steady state
    (`steady_rounds`), `iterations` steady ones are timed again under the calibration plan; while
    the codec still warms up, the plan made on the first timing runs in the meantime.

    Args:
        table: the model's parameters and owner modules.
        host: the cost model's host time per op (taken out of the timed backward passes).
        channels: for the gather of the ranks' layer times.
        name: the profile's name.
    """

    times_layers = True

    def __init__(self, table: ParameterTable, host: float, channels: Channels, warmup: int, iterations: int,
                 name: str, steady_rounds: list[tuple[str, ...]]):
        self.timer = LayerTimer(table)
        self.host = host
        self.channels = channels
        self.warmup = warmup
        self.iterations = iterations
        self.name = name
        self.steady_rounds = set(steady_rounds)
        self.seen = 0
        self.counted = 0
        self.all_steady = True
        self.interim: ModelProfile | None = None  # the profile of the plan run while the codec warms up
        self.update_samples: list[float] = []  # IterationStats.update_time of the counted iterations

    def forward_start(self) -> None:
        self.timer.forward_start()

    def module_start(self, module_name: str) -> None:
        self.timer.module_start(module_name)

    def gradient_ready(self, name: str) -> None:
        self.timer.gradient_ready(name)

    def exclude(self, seconds: float) -> None:
        self.timer.exclude(seconds)

    def iteration_done(self, done: IterationDone) -> Install | ProfileMeasured | None:
        self.seen += 1
        next_steady = done.next_rounds in self.steady_rounds
        if self.seen <= self.warmup:
            return None
        if self.interim is not None:  # the codec warms up under a plan made on its warm-up iterations
            if not next_steady:
                return None
            interim, self.interim = self.interim, None
            return Install(interim, one_bucket())  # back to the calibration plan, to time steady ones
        self.timer.count_iteration()
        self.update_samples.append(done.stats.update_time)
        self.counted += 1
        self.all_steady = self.all_steady and done.rounds in self.steady_rounds
        if self.counted < self.iterations:
            return None
        if not self.all_steady:  # time steady iterations again, under the calibration plan
            request = None
            if not next_steady:  # meanwhile, a plan made on these
                self.interim = self._slowest_profile(done).profile
                request = Install(self.interim)
            self.timer.clear()
            self.update_samples.clear()
            self.counted, self.all_steady = 0, True
            return request
        self.timer.remove()
        return self._slowest_profile(done)

    def _slowest_profile(self, done: IterationDone) -> ProfileMeasured:
        """The timed profile, the timed plan's host time taken out, combined over the ranks."""
        profile = without_host(self.timer.profile(self.name, median(self.update_samples)), done.timed_plan, self.host)
        with waiting_for("the gather of the ranks' layer times", self.channels.timeout):
            gathered = gather_from_all(profile.to_dict(), self.channels.process_group)
        rank_profiles = tuple(ModelProfile.from_dict(data) for data in gathered)
        return ProfileMeasured(slowest_times(list(rank_profiles)), rank_profiles)

"""Per-iteration statistics: where a rank's time went in each synchronised iteration, beside the
simulator's prediction (``IterationStats``), and the clock that splits it (``IterationClock``)."""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from .executor import PlanExecutor

HISTORY_LENGTH = 10_000  # iterations whose statistics IterationClock.history keeps (the most recent)


@dataclass(frozen=True)
class IterationStats:
    """One iteration as measured on this rank, beside the simulator's prediction (seconds)."""

    iteration: int
    iteration_time: float  # from the end of the previous step to the end of this one
    comm_wait: float  # time blocked on communication: the non-overlapped part
    bytes_sent: int
    predicted_time: float
    update_time: float = 0.0  # serial work: buffer broadcast, optimizer step, codec work outside the hooks
    busy_time: float = 0.0  # from the iteration's first forward to the end of its step, less comm_wait
    compute_scale: float = 1.0  # the factor on the profile's times the prediction was made with
    codec_time: float = 0.0  # the codec's encoding in this step and decoding in this iteration's waits
    replans: int = 0  # times the plans were made again online so far (``runtime.measure.cost_watch``)

    def metrics(self, gradient_bytes: int) -> dict[str, float]:
        """What the front-ends log per iteration: measured and predicted time, non-overlapped
        communication (comm_wait), the codec's encoding and decoding (codec_time), bytes sent by
        this rank, the compression ratio (bytes sent / `gradient_bytes`, the uncompressed ones) and
        the re-plannings online so far (replans)."""
        return {"iteration_time": self.iteration_time, "predicted_time": self.predicted_time,
                "comm_wait": self.comm_wait, "codec_time": self.codec_time, "bytes_sent": float(self.bytes_sent),
                "compression_ratio": self.bytes_sent / gradient_bytes, "replans": float(self.replans)}


class IterationClock:
    """Splits the current iteration's time into communication wait, update time (serial work
    outside the layers) and the codec's decoding, and keeps the finished iterations' statistics."""

    def __init__(self):
        self.history: deque[IterationStats] = deque(maxlen=HISTORY_LENGTH)
        self.iteration = 0  # finished iterations (`history` keeps the latest)
        self.iteration_started = time.perf_counter()
        self.forward_started: float | None = None  # the iteration's first forward
        self.comm_wait = self.update_time = self.decode_time = 0.0

    def forward_begins(self) -> None:
        """A forward pass begins (only the iteration's first one is kept)."""
        if self.forward_started is None:
            self.forward_started = time.perf_counter()

    def wait(self, executor: PlanExecutor, wait: Callable[[], None]) -> None:
        """Run `wait` on `executor`'s ops: its time is communication wait, except the codec's
        decoding inside it, which is update time."""
        decoded, started = executor.decode_seconds, time.perf_counter()
        wait()
        decoding = executor.decode_seconds - decoded
        self.comm_wait += time.perf_counter() - started - decoding
        self.update_time += decoding
        self.decode_time += decoding

    @contextmanager
    def updating(self):
        """Time the block as update time (optimizer step, a codec's work outside the hooks)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.update_time += time.perf_counter() - started

    def busy_time(self, now: float) -> float:
        """From the iteration's first forward (or its start) to `now`, less the communication wait."""
        return max(0.0, now - (self.forward_started or self.iteration_started) - self.comm_wait)

    def finish(self, now: float, bytes_sent: int, predicted_time: float, compute_scale: float,
               encode_time: float, replans: int = 0) -> IterationStats:
        """Close the iteration at `now`, record its statistics and start the next one.

        Args:
            now: ``time.perf_counter()`` at the end of the step.
            bytes_sent: what the iteration's ops put on the wire.
            predicted_time: the simulator's iteration time for the step.
            compute_scale: the factor on the profile's times the prediction was made with.
            encode_time: the codec's encoding in this step (its decoding is timed by `wait`).
            replans: the re-plannings online so far.
        """
        stats = IterationStats(self.iteration, now - self.iteration_started, self.comm_wait, bytes_sent,
                               predicted_time, self.update_time, self.busy_time(now), compute_scale,
                               encode_time + self.decode_time, replans)
        self.history.append(stats)
        self.iteration += 1
        self.iteration_started, self.forward_started = now, None
        self.comm_wait = self.update_time = self.decode_time = 0.0
        return stats

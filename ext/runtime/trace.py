"""Chrome/Perfetto trace per rank: forward and backward spans per layer, ops per channel.

Open the file in chrome://tracing or ui.perfetto.dev. Backward spans run from the previous layer's
gradients becoming ready to this layer's (what hooks can see of the backward pass).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

_COMPUTE, _CHANNEL0 = 0, 1


class ChromeTrace:
    """Collects events in memory and writes ``<stem>.rank<r><suffix>`` on `close`."""

    def __init__(self, path: str | Path, rank: int):
        path = Path(path)
        self.path = path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.json'}")
        self.rank = rank
        self.origin = time.perf_counter()
        self.events: list[dict] = []
        self.open_forward: dict[str, float] = {}
        self.last_ready: float | None = None

    def _us(self, seconds: float) -> float:
        return (seconds - self.origin) * 1e6

    def _span(self, name: str, row: int, start: float, end: float, **args) -> None:
        self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": row, "ts": self._us(start),
                            "dur": max(0.0, (end - start) * 1e6), "args": args})

    def forward_start(self, layer: str) -> None:
        self.open_forward[layer] = time.perf_counter()

    def forward_end(self, layer: str) -> None:
        if layer in self.open_forward:
            self._span(f"forward {layer}", _COMPUTE, self.open_forward.pop(layer), time.perf_counter())

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.events.append({"name": name, "ph": "i", "s": "p", "pid": self.rank, "tid": _COMPUTE, "ts": self._us(now)})
        if name == "backward start":
            self.last_ready = now

    def gradient_ready(self, layer: str) -> None:
        now = time.perf_counter()
        self._span(f"backward {layer}", _COMPUTE, self.last_ready or now, now)
        self.last_ready = now

    def op(self, index: int, channel: int, start: float, end: float, nbytes: int) -> None:
        """An op's span on its channel's row.

        Args:
            index: the op's position in its plan.
            channel: the channel it ran on.
            start, end: ``time.perf_counter()`` at its launch and completion.
            nbytes: the bytes it sent.
        """
        self._span(f"op {index}", _CHANNEL0 + channel, start, end, bytes=nbytes)

    def iteration(self, stats) -> None:
        self.events.append({"name": "iteration", "ph": "C", "pid": self.rank, "ts": self._us(time.perf_counter()),
                            "args": {"iteration_ms": stats.iteration_time * 1e3, "comm_wait_ms": stats.comm_wait * 1e3,
                                     "codec_ms": stats.codec_time * 1e3}})

    def close(self) -> Path:
        names = [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": _COMPUTE, "args": {"name": "compute"}}]
        channels = {e["tid"] for e in self.events if e.get("tid", 0) >= _CHANNEL0}
        names += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": t,
                   "args": {"name": f"channel {t - _CHANNEL0}"}} for t in sorted(channels)]
        self.path.write_text(json.dumps({"traceEvents": names + self.events, "displayTimeUnit": "ms"}))
        return self.path

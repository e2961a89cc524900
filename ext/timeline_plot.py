"""Gantt chart of a simulated iteration: one compute row, one row per channel (the papers' Fig. 1–3)."""
from __future__ import annotations

from pathlib import Path

from .simulate import Timeline

_COLOURS = {"backward": "#4C72B0", "forward": "#55A868", "comm-backward": "#DD8452", "comm-forward": "#C44E52"}


def plot_timeline(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    """Write the chart as PNG to `path` and return the path.

    Args:
        timeline: the simulated iteration; its times (seconds) are drawn in milliseconds.
        path: the PNG file to write (its folder must exist); an existing file is overwritten.
        title: put before the iteration and non-overlapped communication times in the chart's
            title ("": those times alone).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    channels = 1 + max((span.channel for span in timeline.ops), default=0)
    figure, axes = plt.subplots(figsize=(12, 1.2 + 0.6 * (channels + 1)))
    scale = 1e3  # seconds -> milliseconds
    for span in timeline.layers:
        axes.broken_barh(
            [(span.start * scale, (span.end - span.start) * scale)], (channels + 0.6, 0.8),
            facecolors=_COLOURS[span.kind], edgecolor="white", linewidth=0.3,
        )
    for span in timeline.ops:
        axes.broken_barh(
            [(span.start * scale, (span.end - span.start) * scale)], (channels - 1 - span.channel + 0.6, 0.8),
            facecolors=_COLOURS[f"comm-{span.phase}"], edgecolor="white", linewidth=0.3,
        )
    axes.set_yticks([channels - c + 0.0 for c in range(channels)] + [channels + 1.0])
    axes.set_yticklabels([f"channel {c}" for c in range(channels)] + ["compute"])
    axes.set_xlabel("time since backward start (ms)")
    axes.set_xlim(0, timeline.iteration_time * scale * 1.01)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    axes.legend(handles, ["backward", "forward", "all-reduce (backward phase)", "all-reduce (forward phase)"],
                loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize="small", frameon=False)
    numbers = (f"iteration {timeline.iteration_time * scale:.2f} ms, "
               f"non-overlapped communication {timeline.noncovered_comm * scale:.2f} ms")
    axes.set_title(f"{title}: {numbers}" if title else numbers)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path

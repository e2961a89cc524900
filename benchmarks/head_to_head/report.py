"""The head-to-head's report: the markdown (the environment, the notes on what is measured, the
targets, per setting its fitted cost, host use, table and auto's logged decisions), the JSON that
benchmarks.simulator_replay re-predicts from, and the chart."""
from __future__ import annotations

import os
import statistics
from pathlib import Path

from .results import RowResult, Setting, median_cost, speedup
from .rows import COMPUTE_ONLY, LOW_RANK, START_ITER
from .targets import targets
from .workloads import EMULATED_DEVICE, EMULATED_SIZE_SCALE, REAL_MODELS, WORKLOADS


def cost_line(fits: list[dict], world_size: int) -> str:
    """The job's fitted all-reduce cost, the median of its fits (`median_cost`), with b read as a
    ring's per-link bandwidth (2(N−1)/N bytes per byte); and the range of the fits' host time and
    slowdowns."""
    cost = median_cost(fits)
    link_gbps = 2 * (world_size - 1) / world_size * 8 / cost["b"] / 1e9
    line = (f"fitted all-reduce cost a = {cost['a'] * 1e3:.2f} ms, b ≙ {link_gbps:.2f} Gbit/s per ring link,"
            f" γ = {cost['gamma']:.2f}, {cost['ops_per_channel']} op(s) at once per channel,"
            f" host time per op {cost['host'] * 1e3:.2f} ms,"
            f" slowdowns σ = {cost['compute_slowdown']:.2f} (computation), τ = {cost['transfer_slowdown']:.2f}"
            " (transfers)")
    spread = ", ".join(f"{name} {min(fit[key] for fit in fits) * scale:.2f}–{max(fit[key] for fit in fits) * scale:.2f}"
                       for name, key, scale in (("host ms", "host", 1e3), ("σ", "compute_slowdown", 1),
                                                ("τ", "transfer_slowdown", 1)))
    return (line + f"; the median of {len(fits)} fits (before, midway through and after the timed rounds; the rows"
            f" planned with the first): {spread}")


def setting_table(setting: Setting, results: dict[str, RowResult]) -> list[str]:
    lines = ["| row | median ms | speed-up vs torch DDP | non-overlapped comm ms | compression ms | predicted ms | error |",
             "|---|---|---|---|---|---|---|"]
    for label, row in results.items():
        ratio = speedup(results, label)
        name = f"{label} (→ {row.plan})" if row.plan else label
        if row.trials:
            timed = ", ".join(f"{plan} {seconds * 1e3:.0f}" for plan, seconds in row.trials)
            name = name[:-1] + f"; timed {timed} ms in {row.trial_iterations} iterations)"
        lines.append("| " + " | ".join([
            name, f"{row.seconds * 1e3:.1f}", "—" if ratio is None else f"{ratio:.2f}×",
            "—" if row.comm is None else f"{row.comm * 1e3:.1f}",
            "—" if row.codec is None else f"{row.codec * 1e3:.1f}",
            "—" if row.predicted is None else f"{row.predicted * 1e3:.1f}",
            "—" if row.error is None else f"{row.error:+.1%}"]) + " |")
    return lines


NOTES = [
    "Median iteration time over the timed blocks (each block's time is its slowest rank's); speed-up ="
    " torch DDP's time / the row's time. Non-overlapped communication: gradsync's measured wait on"
    " communication (IterationStats.comm_wait of the timed steps); for"
    " torch rows, the row's time minus the compute-only time (forward, backward and step without"
    " communication, measured in the same interleaved loop). Compression: gradsync's encoding and decoding"
    " on the computing thread (IterationStats.codec_time, the ranks' mean; a row without a compressor has"
    " none where its gradients are scaled straight into the op buffers, and counts the reshapes and"
    " copies of the tensors its plan splits over several ops). Predicted: the simulator's iteration time"
    " for the plan the row ran (from its measured profile, its times scaled to the computation's measured"
    " speed, and the job's cost: the median of its fits before, midway through and after the timed rounds);"
    " error = (predicted −"
    " measured) / measured. `→` names the planner `auto` chose, and the plans it timed on the job before"
    " choosing (plan trials, run alone: rounds of 2 iterations per plan, forth then back, torch DDP's buckets"
    " kept unless another plan is faster at 95% confidence; the slowest rank's median visit; the iterations"
    " they took).",
    "auto's targets pair the blocks of a round (the rows run interleaved, so a round's blocks share the host's"
    " phase): the median over rounds of torch DDP's time, or the best fixed plan's, over auto's, with the"
    " sign test's 95% interval of that median. The best fixed plan is chosen on the even rounds and compared"
    " on the odd ones, then the other way round: the fastest of several rows on the rounds it is compared on"
    " is partly the luckiest (the winner's curse), which would understate auto by that luck.",
    f"Compressors: rank {LOW_RANK}, {START_ITER} uncompressed steps first, error feedback, for the torch"
    " PowerSGD hook and gradsync's powersgd and acp_sgd alike; plain SGD (lr 0.01) everywhere. The PowerSGD"
    " hook row runs DDP with one bucket: on gloo the hook's second all-reduce is launched from a callback"
    " thread and, with several buckets, races with the next bucket's first one (collective mismatch).",
]


def workload_notes(models: set[str], time_scale: float = 1.0) -> list[str]:
    """What the run's models compute: real ranks' batches, or the emulated accelerators (in slow
    motion where `time_scale` > 1)."""
    notes = []
    real = [name for name in REAL_MODELS if name in models]
    if real:
        notes.append("One rank's batch of synthetic data: " + ", ".join(
            f"{name} {WORKLOADS[name].batch} {WORKLOADS[name].samples}" for name in real)
            + ", sized for the balance of computation and communication at 1 Gbit/s (REPRODUCTION.md).")
    if models - set(real):
        notes.append(
            f"Emulated models (gradsync.emulated): the zoo's layers with their forward and backward times on a"
            f" {EMULATED_DEVICE}, waited without occupying a core, so that the ranks' cores are left to the"
            f" communication as on the papers' GPUs; every tensor holds {EMULATED_SIZE_SCALE:g} of its elements"
            f" (gradient writes, reductions and transfers stay within 2 cores), so a link of R Gbit/s stands for"
            f" R / {EMULATED_SIZE_SCALE:g} Gbit/s for the full-size model. The compressors' encoding and decoding"
            " is real CPU work on the scaled tensors.")
        if time_scale != 1:
            notes.append(
                f"Slow motion: every emulated layer's forward and backward time is ×{time_scale:g}, so a link of"
                f" R Gbit/s stands for R × {time_scale:g} / {EMULATED_SIZE_SCALE:g} Gbit/s at the device's speed;"
                " the host's own cost per op (Python, gloo, the kernel's network stack) is not slowed, and so"
                f" weighs 1/{time_scale:g} as much as at full speed: a host that much faster than its device, as"
                " the papers' hosts are beside their GPUs.")
    return notes


def markdown(command: str, summaries: dict[Setting, dict[str, RowResult]], costs: dict[Setting, str],
             failures: dict[Setting, str], environment: str) -> str:
    models = {setting.model for setting in [*summaries, *failures]}
    time_scale = max((setting.time_scale for setting in [*summaries, *failures]), default=1.0)  # one per run
    lines = ["# Head-to-head on the emulated cluster", "", f"Command: `{command}`", "", environment, "",
             *NOTES, *workload_notes(models, time_scale), "", "## Targets", "", *targets(summaries), ""]
    for setting in [*summaries, *failures]:
        lines += [f"## {setting.title}", ""]
        if setting in failures:
            lines += [f"Failed: {failures[setting]}", ""]
            continue
        lines += [costs[setting], "", *setting_table(setting, summaries[setting]), "",
                  *decision_lines(summaries[setting])]
    return "\n".join(lines)


def decision_lines(results: dict[str, RowResult]) -> list[str]:
    """Each gradsync row's decisions as rank 0 logged them (auto's trials and follow-up rounds, its
    trials started again, the re-plannings online), by the row's step (its calibration's included)."""
    lines = []
    for label, row in results.items():
        if row.decisions:
            lines += [f"{label}, its decisions (rank 0's log; by the row's step, of {row.settled_after} before the "
                      "timed rounds):", "", *(f"- {decision}" for decision in row.decisions), ""]
    return lines


def replay_file(summaries: dict[Setting, dict[str, RowResult]]) -> dict:
    """Per setting, every row's measured time and blocks (the slowest rank's, in run order, so the
    rows can be paired by round again) and, for gradsync rows, the prediction and what it was
    predicted from: the data benchmarks.simulator_replay re-predicts (a torch row's `replay` is None)."""
    return {setting.title: {label: {"seconds": row.seconds, "blocks": list(row.blocks), "predicted": row.predicted,
                                    "replay": row.replay, "calibration_seconds": list(row.calibration_seconds)}
                            for label, row in results.items()}
            for setting, results in summaries.items()}


def chart(summaries: dict[Setting, dict[str, RowResult]], path: Path) -> None:
    """One panel per setting: each row's speed-up over torch DDP (bars), 1× marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(4, len(summaries))
    rows = -(-len(summaries) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 4.5 * rows), squeeze=False)
    for axis in axes.flat[len(summaries):]:
        axis.set_visible(False)
    for axis, (setting, results) in zip(axes.flat, summaries.items()):
        labels = [label for label in results if label != COMPUTE_ONLY]
        values = [speedup(results, label) or 0.0 for label in labels]
        colors = ["#C44E52" if label.startswith("torch") else "#4C72B0" for label in labels]
        axis.barh(range(len(labels)), values, color=colors)
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.set_yticks(range(len(labels)))
        axis.set_yticklabels([label.replace("gradsync ", "") for label in labels], fontsize="small")
        axis.invert_yaxis()
        axis.set_title(setting.title.replace(", ", "\n", 1), fontsize="small")
        axis.set_xlabel("speed-up vs torch DDP")
        for position, value in enumerate(values):
            axis.text(value, position, f" {value:.2f}", va="center", fontsize="x-small")
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def stolen_cpu_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """CPU time the hypervisor has given to others so far (the steal column of the `cpu` line of
    /proc/stat), or None where there is no such column."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def steal_note(before: float | None, after: float | None, seconds: float) -> str:
    """The run's stolen CPU time as a sentence ('' where it was not readable)."""
    if before is None or after is None:
        return ""
    stolen = after - before
    return (f" The hypervisor took {stolen:.1f} s of CPU time from the machine during the run"
            f" ({stolen / (seconds * os.cpu_count()):.1%} of its cores' time).")


def host_line(reports: list[dict], stolen: float | None, seconds: float) -> str:
    """How busy the host was in a setting's rounds: each rank's CPU time (its threads', gloo's
    included) per second of them, and the hypervisor's steal over the job, so that a reader can
    tell a measurement of scheduling from one of the host's contention."""
    shares = [report["cpu_share"] for report in reports]
    line = (f"Host: the ranks used {statistics.fmean(shares):.0%} of a core each on average (at most"
            f" {max(shares):.0%}) during the rounds, {sum(shares):.2f} of the machine's {os.cpu_count()} cores")
    if stolen is not None:
        line += f"; the hypervisor took {stolen / (seconds * os.cpu_count()):.1%} of the cores' time during the job"
    return line + "."

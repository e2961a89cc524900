"""The head-to-head's rows: torch DDP, its PowerSGD hook and gradsync's plans, each a Row named
once; which run by default, on request, or only on a topology."""
from __future__ import annotations

from dataclasses import dataclass, field

LOW_RANK = 4  # PowerSGD's r, equal for the torch hook and gradsync's powersgd and acp_sgd
START_ITER = 2  # uncompressed steps before compression (the least the torch hook allows with error feedback)
ONE_BUCKET_MB = 1024  # larger than any model here
COMPUTE_ONLY = "compute only"  # the reference trained without communication, in the same loop


@dataclass(frozen=True)
class Row:
    """A torch DDP row (no `scheduler`) or a gradsync row (planner `scheduler` and its `options`,
    optional compressor, transport)."""

    label: str
    scheduler: str | None = None
    options: dict = field(default_factory=dict)
    compressor: dict | None = None
    powersgd_hook: bool = False
    transport: str = "allreduce"

    @property
    def is_gradsync(self) -> bool:
        return self.scheduler is not None


def low_rank(name: str) -> dict:
    return {"type": name, "rank": LOW_RANK, "start_iter": START_ITER}


PLANNER_ROWS = {"wfbp": "wfbp", "ddp_buckets": "ddp", "mg_wfbp": "mg_wfbp", "optimal_merge": "optimal_merge",
                "asc_wfbp": "asc_wfbp", "bytescheduler": "bytescheduler", "us_byte": "us_byte", "auto": "auto"}
# gradsync ddp_buckets runs right after torch DDP: the runtime's overhead is their paired ratio
ROWS = {
    "ddp": Row("torch DDP"),
    "ddp_buckets": Row("gradsync ddp_buckets", scheduler=PLANNER_ROWS["ddp_buckets"]),
    "ddp_powersgd": Row("torch DDP + PowerSGD hook", powersgd_hook=True),
    **{key: Row(f"gradsync {key}", scheduler=planner) for key, planner in PLANNER_ROWS.items()
       if key != "ddp_buckets"},
    "mg_wfbp_overlap": Row("gradsync mg_wfbp overlapping the forward", scheduler="mg_wfbp",
                           options={"overlap_forward": True}),
    "optimal_merge_overlap": Row("gradsync optimal_merge overlapping the forward", scheduler="optimal_merge",
                                 options={"overlap_forward": True}),
    "powersgd": Row("gradsync powersgd", scheduler="auto", compressor=low_rank("powersgd")),
    "acp_sgd": Row("gradsync acp_sgd", scheduler="auto", compressor=low_rank("acp_sgd")),
    "forest": Row("gradsync forest", scheduler="auto", transport="forest"),
    # the cost of giving every rank rank 0's buffers in each backward pass, on plans that overlap the next forward
    "us_byte_no_buffers": Row("gradsync us_byte without buffer broadcast", scheduler="us_byte",
                              options={"broadcast_buffers": False}),
    "mg_wfbp_overlap_no_buffers": Row("gradsync mg_wfbp overlapping, without buffer broadcast", scheduler="mg_wfbp",
                                      options={"overlap_forward": True, "broadcast_buffers": False}),
}
TOPOLOGY_ROWS = ("forest",)  # rows that need a --topology run
ON_REQUEST_ROWS = ("mg_wfbp_overlap", "optimal_merge_overlap", "us_byte_no_buffers",
                   "mg_wfbp_overlap_no_buffers")  # run only where --rows names them
QUICK_ROWS = ("ddp", "ddp_powersgd", "mg_wfbp", "acp_sgd")
# the runtime's overhead: gradsync ddp_buckets against torch DDP on the same buckets, each running this
# many blocks a round, alternating (`job.round_order`)
OVERHEAD_PAIR = (ROWS["ddp"].label, ROWS["ddp_buckets"].label)
OVERHEAD_PAIRS = 4

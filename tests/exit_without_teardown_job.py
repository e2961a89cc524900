"""A 2-rank job for tests/test_runtime_guards.py, one process per rank as torchrun starts them:
gradsync is attached and trains, and the script ends with neither a detach nor a
destroy_process_group, as a framework that never tears its engine down leaves it. An exit handler
registered before gradsync's (so run after it) prints what is left.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P python tests/exit_without_teardown_job.py
"""
import atexit
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
runtime = {}


@atexit.register
def report_what_is_left() -> None:
    sync = runtime["sync"]
    print(f"left: {len(sync.channels.groups)} channel group(s); default group up: {dist.is_initialized()}",
          flush=True)


import gradsync  # noqa: E402  (its exit handler runs before the one above)
from runtime_models import COST, TiedNet, batch, synthetic_profile  # noqa: E402

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
model = TiedNet()
model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="asc_wfbp",
                                 profile=synthetic_profile(model), cost=COST, channels=2)
runtime["sync"] = gradsync.runtime.attached(model)
for step in range(3):
    optimizer.zero_grad()
    tokens, targets = batch(rank, step)
    F.cross_entropy(model(tokens), targets).backward()
    optimizer.step()
print(f"trained: {len(runtime['sync'].channels.groups)} channel group(s)", flush=True)

"""A 2-rank job for tests/test_runtime_guards.py, one process per rank as torchrun starts them:
rank 1 kills itself (SIGKILL) at step 5; rank 0 prints when its error came and exits with 3.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P python tests/killed_peer_job.py TIMEOUT
"""
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

import gradsync  # noqa: E402
from runtime_models import COST, TiedNet, batch, synthetic_profile  # noqa: E402

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
model = TiedNet()
model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                 profile=synthetic_profile(model), cost=COST, timeout=float(sys.argv[1]))
try:
    for step in range(1000):
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        tokens, targets = batch(rank, step)
        F.cross_entropy(model(tokens), targets).backward()
        optimizer.step()
except RuntimeError as failure:
    print(f"error at {time.time():.3f}: {type(failure).__name__}", flush=True)
    # the process ends here: an interpreter teardown with the backend's threads still running can
    # abort inside gloo (SIGABRT), which is the backend's, not the error path under test
    os._exit(3)

"""Lightning's own DeepSpeedStrategy with a "gradsync" section in its config, ``import gradsync``
coming before DeepSpeed is loaded: `python lightning_deepspeed_job.py OUT [cpu|cuda]` with a cost model in OUT/cost.json; rank 0
writes what ran to OUT/ran.json and DeepSpeed's csv monitor writes under OUT/monitor.

Lightning's DeepSpeedStrategy refuses any accelerator but CUDA; on CPU (2 ranks, gloo) the job
runs it with that one check lifted and DeepSpeed's CPU accelerator, the rest of it unchanged
(DeepSpeed's backend starting without its shared-memory op, as in tests/deepspeed_job.py).
"""
import importlib
import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

import gradsync  # noqa: F401  (its entry in DeepSpeed's engine)

DEEPSPEED_BEFORE_GRADSYNC = "deepspeed" in sys.modules  # no: Lightning imports it when the strategy starts

STEPS = 6


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    def setup_environment(self) -> None:
        # the op serves inference_all_reduce alone, and its first build takes about half a minute
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's, less its CUDA-only check


class TinyRegression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(self.global_rank)
        inputs = torch.randn(8 * STEPS, 8, generator=generator)
        data = torch.utils.data.TensorDataset(inputs, inputs @ torch.ones(8, 4))
        return torch.utils.data.DataLoader(data, batch_size=8)

    def on_train_end(self):
        engine = self.trainer.strategy.model
        report = engine.gradsync.report()
        weights = torch.cat([p.detach().reshape(-1) for p in self.parameters()]).double()
        gathered = self.all_gather(weights.sum())
        self.ran = {"engine": type(engine).__name__, "scheduler": report.scheduler, "iterations": report.iteration,
                    "backward_allreduce": engine.enable_backward_allreduce,
                    "replica_sums": gathered.tolist()}


def main() -> None:
    out, device = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu"
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
              "csv_monitor": {"enabled": True, "output_path": str(out / "monitor"), "job_name": "lightning"},
              "gradsync": {"scheduler": "wfbp", "cost": str(out / "cost.json")}}
    if device == "cpu":  # indexed devices, as the strategy's device check expects of GPUs
        strategy = CPUDeepSpeedStrategy(config=config, parallel_devices=[torch.device("cpu", i) for i in range(2)])
    else:
        strategy = DeepSpeedStrategy(config=config)
    module = TinyRegression()
    trainer = pl.Trainer(accelerator=device, devices=2 if device == "cpu" else 1, strategy=strategy,
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module)
    # Lightning leaves DeepSpeed's engine to the interpreter's exit; destroyed here, as a script
    # would, gradsync's process groups go first (one left to the exit once aborted the process)
    strategy.model.destroy()
    if trainer.global_rank == 0:
        (out / "ran.json").write_text(json.dumps({**module.ran, "deepspeed_before_gradsync": DEEPSPEED_BEFORE_GRADSYNC}))


if __name__ == "__main__":
    main()

"""LightningCLI with gradsync's strategy given by class path in a YAML config, in a script that
never imports gradsync itself (jsonargparse imports the class): `python lightning_cli_job.py
CONFIG OUT`; rank 0 writes what ran to OUT (JSON)."""
import json
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import LightningCLI


class TinyClassifier(pl.LightningModule):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self):
        """What ran, while gradsync is still attached (it detaches at the strategy's teardown)."""
        strategy = self.trainer.strategy
        report = strategy.runtime.report()
        self.ran = {"strategy": f"{type(strategy).__module__}.{type(strategy).__name__}",
                    "scheduler": report.scheduler, "compressor": report.compressor, "iterations": report.iteration,
                    "codec": strategy.runtime.codec.settings()}

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=generator),
                                              torch.randint(0, 4, (64,), generator=generator))
        return torch.utils.data.DataLoader(data, batch_size=8)


if __name__ == "__main__":
    config, out = sys.argv[1], sys.argv[2]
    cli = LightningCLI(TinyClassifier, args=["--config", config], run=False, save_config_callback=None)
    cli.trainer.fit(cli.model)
    if cli.trainer.is_global_zero:
        with open(out, "w") as handle:
            json.dump(cli.model.ran, handle)

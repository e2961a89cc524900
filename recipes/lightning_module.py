"""Lightning pieces of the recipes: the classifier, its data, and the callbacks that report a job.

The data module gives each rank its own shard (gradsync.recipes.data does the split), so the
Trainer runs with ``use_distributed_sampler=False``.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.trainer.states import TrainerFn
from typing_extensions import override

from ..errors import ConfigError
from . import data


class Classifier(pl.LightningModule):
    """A classifier network trained with SGD + momentum on cross-entropy.

    Args:
        network: the module mapping a batch of samples to class scores (the recipes build one of
            gradsync.recipes.models).
        lr: SGD's learning rate.
        momentum: SGD's momentum.
    """

    def __init__(self, network: torch.nn.Module, lr: float = 0.05, momentum: float = 0.9):
        super().__init__()
        self.save_hyperparameters(ignore=["network"])  # the network is in the job config and the checkpoint
        self.network = network
        self.correct = self.seen = 0

    def forward(self, inputs):
        return self.network(inputs)

    def training_step(self, batch, _index):
        inputs, labels = batch
        loss = F.cross_entropy(self(inputs), labels)
        self.log("train/loss", loss)
        return loss

    def on_validation_epoch_start(self) -> None:
        self.correct = self.seen = 0

    def validation_step(self, batch, _index):
        inputs, labels = batch
        self.correct += int((self(inputs).argmax(dim=1) == labels).sum())
        self.seen += len(labels)

    def on_validation_epoch_end(self) -> None:
        # every rank evaluates the whole test set with the same weights: the mean is that value
        self.log("test/accuracy", 100.0 * self.correct / self.seen, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


class ShardedData(pl.LightningDataModule):
    """A data set of gradsync.recipes.data: this rank's training shard and the whole test set,
    checked against what the config says it gives (the model's options are read from that). Its
    errors name the recipe's keys (``data.classes``, ``data.dataset``).

    Args:
        dataset: one of gradsync.recipes.data's loaders with its options bound (a partial); the
            data module passes it the rank's place and the batch size.
        batch_size: training samples per batch on each rank.
        classes, features, vocab: what the data set gives (classes, values per sample, the token
            bound of token data, else None); a value the data set does not have raises ConfigError.
        rank, world_size: this rank and the number of ranks.
        seed: shuffles this rank's shard.
    """

    def __init__(self, dataset: Callable[..., data.Split], batch_size: int, classes: int, features: int,
                 vocab: int | None = None, rank: int = 0, world_size: int = 1, seed: int = 0):
        super().__init__()
        name = getattr(dataset, "func", dataset).__name__
        try:
            self.split = dataset(rank=rank, world_size=world_size, batch_size=batch_size, seed=seed)
        except ConfigError as exc:
            raise ConfigError(f"data.dataset: {exc}") from exc
        for key, declared in (("classes", classes), ("features", features), ("vocab", vocab)):
            value = getattr(self.split, key)
            if declared != value:
                raise ConfigError(f"data.{key}: data {name!r} has {key} {value}, got {declared!r}")

    def train_dataloader(self):
        return self.split.train

    def val_dataloader(self):
        return self.split.test


class EpochReport(pl.Callback):
    """Prints the test accuracy after each evaluation on rank 0 and keeps the list, with the
    training step it was taken at."""

    def __init__(self):
        self.accuracy: list[float] = []
        self.validated_step = None

    def on_validation_end(self, trainer, _module) -> None:
        if trainer.sanity_checking:
            return
        value = float(trainer.callback_metrics["test/accuracy"])
        self.accuracy.append(value)
        self.validated_step = trainer.global_step
        if trainer.is_global_zero:
            after_fit = trainer.state.fn == TrainerFn.VALIDATING
            where = f"end of training (step {trainer.global_step})" if after_fit else f"epoch {trainer.current_epoch + 1}"
            print(f"{where}: test accuracy {value:.2f}%", flush=True)


class IterationTimer(pl.Callback):
    """Wall time of every training step (forward, backward, synchronisation, update) on this rank,
    and the iteration breakdown of gradsync's runtime (`runtime_of(trainer)`; None for plain DDP).

    The runtime's first iterations run a calibration plan while layers are timed; only the steps
    after it count. The runtime object is kept: its history and plans outlive its teardown."""

    def __init__(self, runtime_of):
        self.runtime_of = runtime_of
        self.runtime = None
        self.step_times: list[float] = []
        self.steady_step = None  # first step under the real plan
        self.steady_iteration = None  # the runtime's iteration count then
        self.started = 0.0

    @override
    def on_train_batch_start(self, _trainer, _module, _batch, _index) -> None:
        self.started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, _module, _outputs, _batch, _index) -> None:
        self.step_times.append(time.perf_counter() - self.started)
        self.runtime = self.runtime_of(trainer) or self.runtime
        if self.steady_step is not None:
            return
        report = None if self.runtime is None else self.runtime.report()
        if report is None or not report.measuring:
            self.steady_step = len(self.step_times)
            self.steady_iteration = None if report is None else report.iteration

    def breakdown(self, samples_per_step: int) -> dict:
        """Median step time and throughput; with gradsync, over the same steps, the medians of the
        runtime's predicted and measured time from an iteration's first forward to the end of its
        step (the span the simulator predicts; Lightning's work between steps is outside it), of
        the non-overlapped communication and of the codec's encoding and decoding time, and the
        mean wire bytes as a fraction of the gradient bytes (the compression ratio, over whole
        codec cycles)."""
        steady = self.step_times[self.steady_step or 0:] or self.step_times
        step = statistics.median(steady)
        result = {"steps": len(steady), "iteration_ms": 1e3 * step, "throughput": samples_per_step / step,
                  "measured_ms": None, "predicted_ms": None, "comm_wait_ms": None, "codec_ms": None,
                  "compression_ratio": None}
        if self.runtime is None:
            return result
        report = self.runtime.report()
        history = [s for s in report.history if s.iteration >= (self.steady_iteration or 0)] or list(report.history)
        median = statistics.median
        result.update(
            measured_ms=1e3 * median(s.busy_time + s.comm_wait for s in history),
            predicted_ms=1e3 * median(s.predicted_time for s in history),
            comm_wait_ms=1e3 * median(s.comm_wait for s in history),
            codec_ms=1e3 * median(s.codec_time for s in history),
            compression_ratio=statistics.fmean(s.bytes_sent for s in history) / report.gradient_bytes,
        )
        return result

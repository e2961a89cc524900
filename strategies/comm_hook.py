"""A Lightning callback that runs gradsync's communication hook under Lightning's own DDPStrategy
and keeps its state in Lightning's checkpoints.

``Trainer(strategy="ddp", callbacks=[CompressionHook(CompressionState(model, "acp_sgd"))])``:
at ``on_fit_start``, after Lightning wrapped the model in DistributedDataParallel and before the
first backward pass, the callback registers ``gradsync.comm_hooks.compression_hook`` on it (on
any device: Lightning's ``ddp_comm_hook`` argument registers hooks on CUDA only). Lightning dumps
a checkpoint on every rank and writes rank 0's: the callback's ``state_dict`` gathers every rank's
state (error feedback differs per rank), and ``load_state_dict`` hands each rank its own, so a
resumed run continues as the uninterrupted one.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..agreement import gather_from_all
from ..comm_hooks import CompressionState, compression_hook
from ..errors import ConfigError


class CompressionHookCallback:
    """The callback's methods, mixed into the Callback class of each installed Lightning package.

    Args:
        state: the CompressionState of the LightningModule being trained.
    """

    def __init__(self, state: CompressionState):
        if not isinstance(state, CompressionState):
            raise ConfigError(f"CompressionHook takes a gradsync.comm_hooks.CompressionState, got {type(state).__name__}")
        self.state = state

    def on_fit_start(self, trainer, pl_module) -> None:
        """Register the hook on Lightning's DistributedDataParallel model.

        Args:
            trainer: the Trainer; its strategy must have wrapped the model in DDP.
            pl_module: the LightningModule (the state's module).
        """
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise ConfigError(f"CompressionHook needs a strategy that wraps the model in DistributedDataParallel "
                              f"(strategy='ddp'), got {type(trainer.strategy).__name__}")
        model.register_comm_hook(self.state, compression_hook)
        scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
        if scaler is not None:  # fp16 AMP: the error feedback follows the scale
            self.state.follow_loss_scale(scaler.get_scale)

    def state_dict(self) -> dict:
        """Every rank's state, gathered (a collective: Lightning calls it on every rank)."""
        return {"per_rank": gather_from_all(self.state.state_dict(), None)}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["per_rank"]
        if len(saved) != dist.get_world_size():
            raise ConfigError(f"the checkpoint holds the communication hook's state of {len(saved)} ranks, this run has "
                              f"{dist.get_world_size()} (error feedback cannot be redistributed)")
        self.state.load_state_dict(saved[dist.get_rank()])

"""gradsync's compressors as torch DDP communication hooks, used as torch's own are::

    state = gradsync.comm_hooks.CompressionState(model, "acp_sgd", rank=4)
    ddp_model.register_comm_hook(state, gradsync.comm_hooks.compression_hook)

Each bucket DDP hands to the hook is one op of gradsync's runtime (a one-op plan run by
`runtime.executor.PlanExecutor`), with one codec over all of the model's parameters, so a hook
computes what `gradsync.wrap` computes for the same tensors and keeps its state per parameter
whatever DDP's buckets are (DDP rebuilds them after the first iteration):

1. At the first call the codec is set up for the model's trainable parameters, after a check that
   every rank holds the same compressor settings, before any gradient travels.
2. Every parameter of the bucket is encoded into the op's buffer, each rank's share of the mean,
   and the buffer is all-reduced (all-gathered for Sign-SGD and Top-k) on the state's process group.
3. Once reduced, the codec decodes the averaged gradients into the bucket. A codec with two rounds
   per step (Power-SGD's P then Q) waits for the first inside the hook and then starts the second:
   every collective is then issued from DDP's thread in bucket order, the same on every rank (one
   started from a callback could overtake another bucket's on one rank and pair wrong buffers).

Non-finite gradients pass through, decoded to non-finite values, so AMP's GradScaler sees them and
skips the step; the codecs keep inf and NaN out of their error feedback, and such a step does not
count: the next one runs as if it had never been (Power-SGD's warm-up steps, ACP-SGD's P and Q
alternation). The averaged gradients are the same on every rank, and so is that decision. ``state_dict`` and
``load_state_dict`` resume a run exactly (the codec's state is keyed by parameter name, as
``gradsync.wrap``'s). The state pickles with its module and without its process group (the
default group then, as torch's PowerSGD state does).
"""
import random
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import compress
from .agreement import check_same_on_all_ranks, share_from_first
from .compress import Codec
from .compress.gradients import all_finite, checksum
from .compress.loss_scale import LossScaleFollower
from .errors import ConfigError
from .plan import Op, Plan, whole
from .runtime.channels import Channels
from .runtime.executor import PlanExecutor
from .runtime.parameter_table import ParameterTable

__all__ = ["CompressionState", "compression_hook"]
# no `from __future__ import annotations`: DDP checks the hook's annotations as objects


class CompressionState:
    """What `compression_hook` keeps between calls: the codec, the step and one executor per
    bucket and wire layout.

    Args:
        module: the model DDP wraps (or the DDP model itself): the codec is set up for its
            trainable parameters, named as in its ``named_parameters()``.
        compressor: a compressor's name (``gradsync.compress.names()``), a ``{"type": name,
            **options}`` dict, or a Codec.
        process_group: the group whose ranks average the gradients (None: the default group), the
            one DDP reduces over.
        seed: the seed of the codec's shared state (the initial low-rank factors); None: rank 0
            draws one at the first call and shares it, as ``gradsync.wrap`` does.
        **options: the compressor's options, when `compressor` is a name.
    """

    def __init__(self, module: torch.nn.Module, compressor="acp_sgd", process_group=None, seed: int | None = None,
                 **options):
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"comm hook state: 'module' must be the torch.nn.Module DDP wraps, got {type(module).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ConfigError(f"comm hook state: 'seed' must be None or an integer >= 0, got {seed!r}")
        if options and not isinstance(compressor, str):
            raise ConfigError("comm hook state: options go with a compressor given by name; a dict or a Codec "
                              f"carries its own (got {sorted(options)})")
        self.module = module.module if isinstance(module, DistributedDataParallel) else module
        self.codec = compress.build({"type": compressor, **options} if options else compressor)
        self.process_group = process_group
        self.seed = seed
        self._steps = 0  # synchronised iterations done with finite gradients (each bucket of one backward sees it)
        self._ending = False  # the current step's last bucket is in: the step counts once its gradients are known
        self._checksums = []  # each decoded bucket's sum in the current step (inf or NaN if a gradient is), on device
        self._between_steps = True  # the next bucket is the first of a step
        self.set_up = False  # whether the codec is set up for the module's parameters
        self._saved = None  # a loaded state_dict, restored into the codec when it is set up
        self._detach()

    def _detach(self) -> None:
        """Forget what belongs to this process: the channel, the executors, the parameters' names."""
        self._channels: Channels | None = None
        self._executors: dict[tuple, PlanExecutor] = {}
        self._names: dict[int, str] = {}
        self._slots: dict[str, torch.Tensor] = {}
        self._gradients: dict[str, torch.Tensor] = {}
        self._loss_scale: LossScaleFollower | None = None

    def follow_loss_scale(self, read_scale) -> None:
        """Follow the loss scale that `read_scale()` returns (a GradScaler's ``get_scale``), in this
        process: read at each step's first bucket, before any gradient is encoded, when the codec
        keeps error feedback; a change since the last one rescales the error feedback, kept in the
        scaled gradients' units (``Codec.rescale_errors``).

        Args:
            read_scale: returns the loss scale the current backward pass ran with.
        """
        self._loss_scale = LossScaleFollower(read_scale)

    def _attach(self) -> None:
        """Step 1 (module docstring), at the first call in this process."""
        table = ParameterTable.of(self.module)
        self._channels = Channels.existing(self.process_group)
        if not self.set_up:
            table.check_compressor(self.codec.name)
            check_same_on_all_ranks((self.codec.name, self.codec.settings(), self.seed),
                                    "compressor settings in its comm hook state",
                                    "build every rank's CompressionState with the same arguments", self.process_group)
            seed = self.seed if self.seed is not None else share_from_first(random.randrange(2**62), self.process_group)
            self.codec.setup(table.tensor_specs(), self._channels.world_size, seed)
            self.set_up = True
            if self._saved is not None:
                self.codec.load_state_dict(*self._saved)
                self._saved = None
        self._names = {id(parameter): name for name, parameter in table.parameters.items()}
        self._slots = {name: parameter.detach() for name, parameter in table.parameters.items()}

    def executor(self, bucket: dist.GradBucket, layout: str) -> PlanExecutor:
        """The executor of `bucket`'s one op under wire `layout`, made at its first use.

        Args:
            bucket: the bucket DDP hands to the hook.
            layout: one of the codec's wire layouts.
        """
        if self._channels is None:
            self._attach()
        try:
            names = tuple(self._names[id(parameter)] for parameter in bucket.parameters() if parameter.numel())
        except KeyError:
            raise ConfigError("comm hook state: DDP reduces a parameter that is not a trainable parameter of the "
                              "module given to CompressionState (give it the model DDP wraps)") from None
        key = (names, layout)
        if key not in self._executors:
            ops = (Op(tuple(whole(self.codec.wire_spec(self.codec.specs[name], layout)) for name in names),
                      codec=self.codec.name),)
            self._executors[key] = PlanExecutor(Plan(ops, planner="ddp_comm_hook"),
                                                {name: self._slots[name] for name in names}, self._channels,
                                                self.codec, layout, nonfinite="ignore")
        return self._executors[key]

    def gradient(self, name: str, gradient: torch.Tensor) -> torch.Tensor:
        """What the codec reads as `name`'s gradient: DDP's bucket view itself for the identity,
        else a copy in a buffer of the state's own. BLAS rounds a product differently with its
        operand at another address alignment, and bucket views sit at any offset: in an aligned
        buffer of its own a codec computes what it computes under ``gradsync.wrap``, whatever the
        buckets (DDP rebuilds them, so a resumed run's differ from the uninterrupted one's).

        Args:
            name: the parameter's name.
            gradient: its gradient in DDP's bucket.
        """
        if self.codec.name == Codec.name:
            return gradient
        buffer = self._gradients.get(name)
        if buffer is None:
            buffer = self._gradients[name] = torch.empty_like(gradient, memory_format=torch.contiguous_format)
        return buffer.copy_(gradient)

    def decoded(self, gradients: torch.Tensor) -> None:
        """Note the averaged `gradients` of a bucket of the current step (their sum, checked once per step)."""
        self._checksums.append(checksum(gradients))  # one append: the buckets' callbacks run on several threads

    @property
    def step(self) -> int:
        """Synchronised steps done whose averaged gradients were finite (read between steps)."""
        self.settle_step()
        return self._steps

    def settle_step(self) -> None:
        """Once a step's last bucket is in and decoded: count the step if its gradients were finite
        (a GradScaler skips it otherwise). DDP waits for every bucket before the optimizer step, so
        this runs at the next step's first bucket, or when the step is read or the state saved."""
        if self._ending:
            applied = not self._checksums or all_finite(*self._checksums)
            self.codec.settle(applied)
            self._steps += applied
            self._ending, self._checksums = False, []

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The step and the codec's state (this rank's: error feedback differs per rank)."""
        step = self.step  # settles the last step first
        codec = self.codec.state_dict() if self.set_up else self._saved
        return {"compressor": self.codec.name, "settings": self.codec.settings(), "step": step, "codec": codec}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict`'s result (saved by this rank)."""
        mine, saved = (self.codec.name, self.codec.settings()), (state["compressor"], state["settings"])
        if saved != mine:
            raise ConfigError(f"comm hook state: the checkpoint was made with compressor and options {saved}, "
                              f"this state has {mine}")
        self._steps, self._ending, self._checksums = state["step"], False, []
        if state["codec"] is None:
            return
        if self.set_up:
            self.codec.load_state_dict(*state["codec"])
        else:
            self._saved = state["codec"]

    def __getstate__(self) -> dict:
        self.settle_step()
        process_bound = ("_channels", "_executors", "_names", "_slots", "_gradients", "_loss_scale")
        state = {k: v for k, v in self.__dict__.items() if k not in process_bound}
        return {**state, "process_group": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._detach()


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average `bucket`'s gradients through `state`'s compressor (module docstring, steps 1–3).

    Args:
        state: the CompressionState registered with the hook.
        bucket: the bucket DDP hands over; its gradients are replaced by the decoded averages.
    """
    step = state.step  # settles the step before, if it ended
    rounds = [state.executor(bucket, layout) for layout in state.codec.rounds(step)]
    if state._between_steps and state._loss_scale is not None:
        state._loss_scale.follow(state.codec)
    state._ending = state._between_steps = bucket.is_last()
    gradients = [gradient for gradient in bucket.gradients() if gradient.numel()]  # as `executor` names them
    slots = list(rounds[0].parameters.values())
    for (name, slot), gradient in zip(rounds[0].parameters.items(), gradients):
        slot.grad = state.gradient(name, gradient)

    *earlier, last = rounds
    for executor in earlier:  # waited for here: every collective is issued from DDP's thread, in bucket order
        _launch(executor, step)
        executor.wait_all()
    _launch(last, step)
    # the callback runs, and its closure is released, on the backend's thread: it holds the state and the
    # executor weakly (DDP holds them until this future completes), so that the last reference to their
    # process group is never dropped there (a process group destroyed from its own thread aborts the process)
    state_ref, last_ref = weakref.ref(state), weakref.ref(last)

    def decoded(_) -> torch.Tensor:
        state, last = state_ref(), last_ref()
        last.collected(0)
        for slot, gradient in zip(slots, gradients):
            if slot.grad.data_ptr() != gradient.data_ptr():  # the codec's own buffer, or the op's adopted
                gradient.copy_(slot.grad.view_as(gradient))
            slot.grad = None
        state.decoded(bucket.buffer())
        return bucket.buffer()

    return last.future(0).then(decoded)


def _launch(executor: PlanExecutor, step: int) -> None:
    """Encode the gradients of `executor`'s op and start it (every parameter counts as produced:
    DDP hands over zeros for one the backward pass did not reach)."""
    executor.start_iteration(step, ready=set(executor.parameters))
    executor.end_backward()

"""gradsync in place of DeepSpeed's gradient reduction under ZeRO stages 1 and 2.

DeepSpeed's ZeRO optimizer (``DeepSpeedZeroOptimizer``) keeps each rank's partition of the flat
parameter groups in fp32 and steps it alone; its own hooks reduce the gradients into
``averaged_gradients``, this rank's partition. Taken over by gradsync:
1. DeepSpeed's gradient hooks are removed (and the engine's all-reduce switched off by the caller),
   so DeepSpeed reduces nothing;
2. gradsync's plan reduces the gradients during the backward pass of the accumulation boundary:
   uncompressed, its ops are reduce-scatters that deliver each rank the elements of its partition
   (``zero_partition``); a compressor's decoded gradients are whole;
3. the ZeRO optimizer's ``step`` (called by the engine at the boundary) waits for the ops, hands
   ZeRO this rank's partition of the averaged gradients in ZeRO's own layout
   (``_build_compact_grad_partition_buffer``), then runs ZeRO's step unchanged: overflow check and
   loss scale (fp16, bf16), clipping, the fp32 update and the all-gather of the parameters (over
   gloo in pieces, two in flight at a time: ``gather``).
A compressor's plan holds the whole gradients until this step (its codec decodes into them), where
DeepSpeed's own reduction frees each in the backward pass. Live past the backward pass, they pin
the heap's free pages below them in resident memory (glibc trims only the heap's top), under ZeRO's
update and its temporaries. Where ZeRO updates on the host, the step hands those pages back before
the update (``runtime.host_memory``). Measured with ``benchmarks.deepspeed_zero`` (acp_sgd, ZeRO-2,
2 ranks): peak resident memory 1.15 → 1.02 of DeepSpeed's own run's, the step 3.6% slower
(334 → 346 ms).
The ZeRO optimizer stays the engine's (``takeover``); its ``state_dict`` carries gradsync's codec
state and step, each rank's in its own ZeRO checkpoint file.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ..runtime import SyncedOptimizer
from ..runtime.executor import PlanExecutor
from ..runtime.host_memory import release_freed_host_memory
from ..runtime.parameter_table import ParameterTable
from ..runtime.partition import Partition
from .gather import parameters_gathered_in_pieces
from .takeover import GradSyncOptimizer, OwnStep, take_over as take_over_own


def zero_partition(zero: DeepSpeedZeroOptimizer, table: ParameterTable) -> Partition:
    """The elements of each parameter's flattened gradient that each rank's ZeRO partition holds.

    Rank r of a group's data-parallel group owns elements [r·P, (r + 1)·P) of the group's flat
    buffer, P = ``partition_size``; each parameter lies in it at its ``round_robin_bit16_offsets``
    entry (alignment padding included)."""
    names = {id(parameter): name for name, parameter in table.parameters.items()}
    spans = {}
    for index, parameters in enumerate(zero.round_robin_bit16_groups):
        size = int(zero.partition_size[index])
        ranks = dist.get_world_size(group=zero.real_dp_process_group[index])
        for parameter, offset in zip(parameters, zero.round_robin_bit16_offsets[index]):
            if parameter.numel() == 0:  # no element to own, and none in gradsync's plans (ParameterTable.empty)
                continue
            end = offset + parameter.numel()
            spans[names.get(id(parameter), f"<a parameter outside the module, {tuple(parameter.shape)}>")] = tuple(
                (max(offset, rank * size) - offset, min(end, (rank + 1) * size) - offset, rank)
                for rank in range(ranks) if max(offset, rank * size) < min(end, (rank + 1) * size))
    return Partition(spans, dist.get_world_size(group=zero.real_dp_process_group[0]))


def partition_places(zero: DeepSpeedZeroOptimizer) -> dict[int, tuple[int, int, int, int]]:
    """Where this rank's partition holds each parameter's elements, fixed once ZeRO is built:
    id(parameter) -> (group, first element this rank owns, its place in the partition, count)."""
    places = {}
    for index, parameters in enumerate(zero.params_in_partition):
        rank = dist.get_rank(group=zero.real_dp_process_group[index])
        size = int(zero.partition_size[index])
        for parameter in parameters:
            identity = zero.get_param_id(parameter)
            start = int(zero.grad_start_offset[index][rank][identity])
            at = int(zero.grad_partition_insertion_offset[index][rank][identity])
            places[id(parameter)] = index, start, at, min(parameter.numel() - start, size - at)
    return places


def deliver_partitions(zero: DeepSpeedZeroOptimizer, executor: PlanExecutor) -> None:
    """Fill ZeRO's ``averaged_gradients`` with this rank's partition of every group, in ZeRO's own
    layout, offsets and dtype. From what the plan's reduce-scatters received (the gradients are
    released by then), or, for a compressor's plan, from the decoded whole gradients. A parameter
    no rank used contributes zeros.

    Args:
        zero: the engine's ZeRO optimizer, taken over (``take_over``).
        executor: the executor of gradsync's last step, its ops waited for.
    """
    groups = [zero._build_compact_grad_partition_buffer(index) for index in range(len(zero.params_in_partition))]
    places = zero.gradsync_places
    if executor.releases_gradients:
        elements = ((executor.parameters[name], start, values) for name, start, values in executor.reduced_partition())
    else:
        elements = ((parameter, place[1], parameter.grad.reshape(-1)[place[1]:place[1] + place[3]])
                    for parameter in executor.parameters.values()
                    if parameter.grad is not None and (place := places.get(id(parameter))) and place[3] > 0)
    for parameter, start, values in elements:
        index, first, at, _ = places[id(parameter)]
        groups[index].flat_partition.narrow(0, at + start - first, values.numel()).copy_(values)
    for index, group in enumerate(groups):
        zero.averaged_gradients[index] = group


class ZeroStep(OwnStep):
    """What gradsync's runtime steps under ZeRO: the module's parameters, whose ``step`` hands the
    ZeRO optimizer this rank's partitions of the averaged gradients and runs its own step."""

    def step(self, closure=None):
        executor = self.owner.gradsync.sync.executor
        deliver_partitions(self.owner, executor)
        executor.release_buffers()  # idle until the next backward pass
        if not executor.releases_gradients and torch.device(self.owner.device).type == "cpu":
            release_freed_host_memory()
        with parameters_gathered_in_pieces(self.owner.real_dp_process_group[0]):
            return self.owner.own_step()


class GradSyncZeroOptimizer(GradSyncOptimizer):
    """The overrides for ZeRO's optimizer, which DeepSpeed saves and loads on every rank from its
    own file."""

    def load_state_dict(self, state_dict_list, *args, **kwargs):
        """ZeRO's load; gradsync's state from this rank's entry (DeepSpeed loads its own file)."""
        mine = state_dict_list[dist.get_rank(group=self.dp_process_group)]
        if mine is not None and "gradsync" in mine:
            self.gradsync.sync.load_state_dict(mine["gradsync"])
        stripped = [None if state is None else {k: v for k, v in state.items() if k != "gradsync"}
                    for state in state_dict_list]
        return super(GradSyncOptimizer, self).load_state_dict(stripped, *args, **kwargs)  # ZeRO's own


def take_over(zero: DeepSpeedZeroOptimizer, synced: SyncedOptimizer) -> None:
    """Remove ZeRO's gradient hooks and route its step through gradsync (`synced`, attached to the
    module with ``ZeroStep`` and ``zero_partition``)."""
    for handle in zero._grad_acc_hooks:
        handle.remove()
    zero._grad_acc_hooks.clear()
    zero.gradsync_places = partition_places(zero)
    take_over_own(zero, synced, GradSyncZeroOptimizer)

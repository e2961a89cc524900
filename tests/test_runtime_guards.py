"""Runtime guards against silent divergence: gradients accumulated under no_sync, updates deferred
into the forward of tied weights, gradients cleared by the model's zero_grad before such an update,
parameters written before their deferred update or read before it, dtype mixes the planners cannot
separate, failed wraps (parameters unfrozen after the wrap: test_unfreezing)."""
import copy
import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import nn

import gradsync
from gradsync import ConfigError
from gradsync.launch import run_local
from gradsync.runtime import attached, engine
from gradsync.runtime.module_hooks import on_module
from gradsync.runtime.parameter_table import ParameterTable
from runtime_models import COST, VOCAB, WIDTH, TiedNet, batch, distance, synthetic_profile, train_side_by_side


def _profile(model):
    table = ParameterTable.of(model)
    return table.profile("guards", None, {m: 1e-3 for m in table.owners}, {m: 2e-3 for m in table.owners})


class TwoBranches(nn.Module):
    """A trunk and two heads; each forward runs one head."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.a = nn.Linear(WIDTH, 4)
        self.b = nn.Linear(WIDTH, 4)

    def forward(self, x, branch):
        return getattr(self, branch)(torch.tanh(self.trunk(x)))


def _branch_loss(model, rank, step, branch):
    generator = torch.Generator().manual_seed(100 * rank + step)
    return model(torch.randn(6, WIDTH, generator=generator), branch).square().mean()


def branch_used_only_under_no_sync(rank, world_size, scheduler):
    """Micro-batch 1 (under no_sync) runs head b alone, micro-batch 2 (synchronised) head a alone:
    b's accumulated gradient must be averaged, as torch DDP does. Every gradient's distance to DDP's."""
    torch.manual_seed(0)
    model = TwoBranches()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=scheduler,
                                     profile=_profile(model), cost=COST)
    for network, no_sync in ((model, gradsync.no_sync(model)), (reference, reference.no_sync())):
        with no_sync:
            _branch_loss(network, rank, 0, "b").backward()
        _branch_loss(network, rank, 1, "a").backward()
    optimizer.synchronize()
    theirs = dict(reference.module.named_parameters())
    distances = {name: (p.grad - theirs[name].grad).abs().max().item() for name, p in model.named_parameters()}
    attached(model).detach()
    return distances


@pytest.mark.parametrize("scheduler", ["wfbp", "us_byte"])
def test_a_parameter_used_only_under_no_sync_is_averaged_like_ddp(scheduler):
    for distances in run_local(branch_used_only_under_no_sync, 2, scheduler):
        assert max(distances.values()) < 1e-6, distances


def two_synchronised_passes_a_step(rank, world_size, scheduler, options):
    """8 steps of momentum SGD, each of two synchronised backward passes (head a's loss; then head a's
    again on rank 0, head b's on the others), beside torch DDP doing the same: the second adds to
    the averages of the first, which every rank sends on, using them or not. The distance to DDP's
    parameters, or the error."""
    torch.manual_seed(0)
    model = TwoBranches()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     scheduler=scheduler, profile=_profile(model), cost=COST, **options)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    def train():
        for step in range(8):
            for network, stepper in ((model, optimizer), (reference, ref_optimizer)):
                stepper.zero_grad()
                _branch_loss(network, rank, 2 * step, "a").backward()
                _branch_loss(network, rank, 2 * step + 1, "a" if rank == 0 else "b").backward()
                stepper.step()

    return distance_or_error(train, model, optimizer, reference)


def distance_or_error(train, model, optimizer, reference):
    """`train()`, then the distance of gradsync's `model` (detached after) to `reference`'s
    parameters, or the message of the RuntimeError it raised.

    Args:
        train: runs the steps of both.
        model, optimizer: gradsync's, wrapped.
        reference: torch DDP's model, or one whose gradients are averaged by hand.
    """
    try:
        train()
        optimizer.synchronize()
    except RuntimeError as error:
        return str(error)
    finally:
        attached(model).detach()
    return distance(model, reference)


@pytest.mark.parametrize("scheduler, options", [("ddp", {}), ("wfbp", {}), ("wfbp", {"overlap_forward": True}),
                                                ("bytescheduler", {"partition_bytes": 256})])
def test_a_second_synchronised_pass_adds_to_the_averages_of_the_first_as_under_ddp(scheduler, options):
    """Lightning's manual accumulation and two ``engine.backward`` calls a DeepSpeed step do this."""
    assert run_local(two_synchronised_passes_a_step, 2, scheduler, options) == [pytest.approx(0, abs=1e-6)] * 2


def test_a_second_synchronised_pass_is_refused_under_a_compressor():
    """Its error feedback would take the first pass's averages for this rank's own gradient."""
    for error in run_local(two_synchronised_passes_a_step, 2, "wfbp", {"compressor": "acp_sgd"}):
        assert "with a compressor or a sharded optimizer" in error and "gradsync.no_sync(model)" in error


class HeadFirst(nn.Module):
    """`head` is registered before `embed` and owns their tied weight, but `embed` reads it first."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.embed.weight = self.head.weight
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens).mean(1))))


def tied_weight_read_first_by_a_non_owner(rank, world_size, scheduler, options):
    """4 steps with every update deferred into the next forward; the distance to DDP's parameters."""
    torch.manual_seed(5)
    model = HeadFirst()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5), scheduler=scheduler,
                                     profile=_profile(model), cost=COST, **options)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    train_side_by_side(((model, optimizer), (reference, ref_optimizer)), rank, 4)
    pending = len(attached(model).deferred.pending)
    optimizer.synchronize()
    apart = distance(model, reference)
    attached(model).detach()
    return pending, apart


@pytest.mark.parametrize("scheduler, options", [("wfbp", {"overlap_forward": True}),
                                                ("us_byte", {"partition_bytes": 256})])
def test_a_tied_weight_is_updated_before_any_module_holding_it_reads_it(scheduler, options):
    for pending, distance in run_local(tied_weight_read_first_by_a_non_owner, 2, scheduler, options):
        assert pending > 0  # the steps did defer updates into the next forward
        assert distance < 1e-6


def head_first_beside_ddp(scheduler: str, options: dict):
    """HeadFirst under gradsync and under torch DDP, each with momentum SGD: (model, optimizer,
    reference, its optimizer)."""
    torch.manual_seed(5)
    model = HeadFirst()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                     scheduler=scheduler, profile=_profile(model), cost=COST, **options)
    return model, optimizer, reference, torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)


def cleared_by_the_models_zero_grad(rank, world_size, scheduler, options, set_to_none):
    """5 steps whose gradients are cleared by ``model.zero_grad`` (as the Hugging Face Trainer and
    many loops do) while some updates wait for their layer's next forward, momentum SGD beside
    torch DDP: the most updates left pending after the clearing, and the distance to DDP's parameters."""
    model, optimizer, reference, ref_optimizer = head_first_beside_ddp(scheduler, options)
    pending, apart = most_pending_beside(model, optimizer, reference, ref_optimizer, rank, 5,
                                         lambda network, _: network.zero_grad(set_to_none=set_to_none))
    return pending, apart, "zero_grad" in model.__dict__


def most_pending_beside(model, optimizer, reference, ref_optimizer, rank: int, steps: int, clear):
    """`steps` steps of gradsync's model and torch DDP's on the same batches, each begun by
    ``clear(network, its optimizer)``: the most updates still pending after that clearing (the last
    step's, which the clearing must leave to their layer's next forward), and the distance to DDP's
    parameters once they are applied (the runtime detached).

    Args:
        model, optimizer: gradsync's, wrapped.
        reference, ref_optimizer: torch DDP's.
        rank, steps: the rank's batches, and how many steps.
        clear: clears a network's gradients before its step's backward pass.
    """
    pending = 0
    for step in range(steps):
        tokens, targets = batch(rank, step)
        for network, stepper in ((model, optimizer), (reference, ref_optimizer)):
            clear(network, stepper)
            if network is model:
                pending = max(pending, len(attached(model).deferred.pending))
            F.cross_entropy(network(tokens), targets).backward()
            stepper.step()
    optimizer.synchronize()
    apart = distance(model, reference)
    attached(model).detach()
    return pending, apart


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("scheduler, options", [("wfbp", {"overlap_forward": True}),
                                                ("us_byte", {"partition_bytes": 256})])
def test_the_models_zero_grad_leaves_a_deferred_update_its_gradients(scheduler, options, set_to_none):
    for pending, apart, still_overridden in run_local(cleared_by_the_models_zero_grad, 2, scheduler, options,
                                                      set_to_none):
        assert pending > 0
        assert apart < 1e-6
        assert not still_overridden  # detach gives the model torch's zero_grad back


def by_attribute(network: nn.Module) -> list[torch.Tensor]:
    """HeadFirst's parameters read as attributes of its modules (not through ``parameters()``)."""
    module = network.module if isinstance(network, nn.parallel.DistributedDataParallel) else network
    return [module.head.weight, module.head.bias, module.mix.weight, module.mix.bias]


def clamped_after_each_step(rank, world_size, scheduler, options, reach):
    """5 steps with weight clipping after each (a WGAN critic's), momentum SGD beside torch DDP,
    while some updates wait for their layer's next forward; the clipping reaches the parameters
    through `reach`: "parameters" (``model.parameters()``, which applies those updates first),
    "attributes" (the modules' attributes), or "synchronized" (the attributes, after
    ``optimizer.synchronize()``). Returns the distance to DDP's parameters, or the error, whether the
    parameters are as the clipping left them, the updates still pending, and whether detach raised
    it again and detached all the same."""
    model, optimizer, reference, ref_optimizer = head_first_beside_ddp(scheduler, options)
    try:
        for step in range(5):
            tokens, targets = batch(rank, step)
            for network, stepper in ((model, optimizer), (reference, ref_optimizer)):
                stepper.zero_grad()
                F.cross_entropy(network(tokens), targets).backward()
                stepper.step()
                if reach == "synchronized" and network is model:
                    optimizer.synchronize()
                with torch.no_grad():
                    for parameter in network.parameters() if reach == "parameters" else by_attribute(network):
                        parameter.clamp_(-0.1, 0.1)
        optimizer.synchronize()
    except gradsync.ParametersChangedBeforeUpdate as error:
        clamped = all(bool((p.abs() <= 0.1).all()) for p in by_attribute(model))
        pending = len(attached(model).deferred.pending)
        try:
            attached(model).detach()
        except gradsync.ParametersChangedBeforeUpdate:
            return str(error), clamped, pending, "raised again", model not in engine._ATTACHED
    apart = distance(model, reference)
    attached(model).detach()
    return apart


@pytest.mark.parametrize("scheduler, options", [("wfbp", {"overlap_forward": True}),
                                                ("us_byte", {"partition_bytes": 256})])
def test_parameters_written_before_their_deferred_update_are_refused_unless_reached_through_parameters(
        scheduler, options):
    for message, clamped, pending, again, detached in run_local(clamped_after_each_step, 2, scheduler, options,
                                                                "attributes"):
        assert "written in place after optimizer.step()" in message and "optimizer.synchronize()" in message
        assert clamped and pending > 0  # refused before the update: what the clamp wrote is still there
        assert again == "raised again" and detached
    for reach in ("parameters", "synchronized"):
        assert run_local(clamped_after_each_step, 2, scheduler, options, reach) == [pytest.approx(0, abs=1e-6)] * 2


def regrouped_after_two_steps(rank, world_size):
    """US-Byte's updates deferred to the next forward, beside torch DDP, both optimizers' groups
    replaced after two steps by an assignment of ``param_groups`` (as Lightning's finetuning callbacks
    restore theirs on a restart): the mix layer in a group of its own at another learning rate. The
    distance to DDP after three more steps."""
    model, optimizer, reference, ref_optimizer = head_first_beside_ddp("us_byte", {"partition_bytes": 256})
    pairs = ((model, optimizer), (reference, ref_optimizer))
    train_side_by_side(pairs, rank, 2)
    for network, stepper in pairs:
        module = network.module if isinstance(network, nn.parallel.DistributedDataParallel) else network
        mix = {id(p) for p in module.mix.parameters()}
        group = stepper.param_groups[0]
        settings = {k: v for k, v in group.items() if k != "params"}
        stepper.param_groups = [{**settings, "params": [p for p in group["params"] if id(p) not in mix]},
                                {**settings, "lr": 0.05, "params": [p for p in group["params"] if id(p) in mix]}]
    train_side_by_side(pairs, rank, range(2, 5))
    optimizer.synchronize()
    apart = distance(model, reference)
    attached(model).detach()
    return apart


def test_parameter_groups_replaced_by_assignment_are_followed_by_the_deferred_updates():
    assert run_local(regrouped_after_two_steps, 2) == [pytest.approx(0, abs=1e-6)] * 2


class DeviceReading(HeadFirst):
    """Reads its device through parameters() as its forward begins, as Hugging Face models do."""

    def forward(self, tokens):
        sync = engine._ATTACHED.get(self)  # (none on torch DDP's copy)
        pending = len(sync.deferred.pending) if sync else 0
        self.read_device = next(self.parameters()).device
        if sync:
            self.pending_kept.append((pending, len(sync.deferred.pending)))
        return super().forward(tokens)


def read_in_and_out_of_the_forward(rank, world_size):
    """US-Byte's updates deferred to the next forward, beside torch DDP: the model reads its device
    through parameters() in its forward (each layer's update still waits for that layer), and after
    every other step a submodule's named_parameters() are read (every update applied first). Returns the
    updates pending before and after each read in the forward, those pending after each read outside
    it, the distance to DDP, and whether detach left any module gradsync's parameters()."""
    torch.manual_seed(5)
    model = DeviceReading()
    model.pending_kept = []
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5), scheduler="us_byte",
                                     profile=_profile(model), cost=COST, partition_bytes=256)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    pending_after_reads = []
    for step in range(5):
        train_side_by_side(((model, optimizer), (reference, ref_optimizer)), rank, range(step, step + 1))
        if step % 2:  # (else the next forward finds the updates pending)
            pending_after_step = len(attached(model).deferred.pending)
            dict(model.mix.named_parameters())
            pending_after_reads.append((pending_after_step, len(attached(model).deferred.pending)))
    apart = distance(model, reference)
    attached(model).detach()
    overridden = any("parameters" in vars(module) or "named_parameters" in vars(module) for module in model.modules())
    return model.pending_kept, pending_after_reads, apart, overridden


def test_parameters_read_after_the_step_hold_its_updates_and_reads_within_the_forward_wait_for_each_layer():
    for pending_kept, pending_after_reads, apart, overridden in run_local(read_in_and_out_of_the_forward, 2):
        assert any(before > 0 for before, _ in pending_kept)  # updates were deferred to the forward
        assert all(before == after for before, after in pending_kept)
        assert any(before > 0 for before, _ in pending_after_reads)
        assert all(after == 0 for _, after in pending_after_reads)
        assert apart < 1e-6
        assert not overridden


def test_a_copy_of_the_model_gets_torchs_zero_grad(monkeypatch):
    """The model's zero_grad is gradsync's only while attached, and only on the model itself."""
    model = nn.Linear(2, 2)
    zeroed = []
    monkeypatch.setitem(engine._ATTACHED, model, type("Sync", (), {"zero_grad": lambda _, ps, s: zeroed.append(s)})())
    model.zero_grad = types.MethodType(engine._zero_grad_while_attached, model)
    model.zero_grad(set_to_none=False)
    assert zeroed == [False]
    copied = copy.deepcopy(model)
    copied.weight.grad = torch.ones(2, 2)
    copied.zero_grad()
    assert copied.weight.grad is None and zeroed == [False]  # torch's own, on the copy


class GlobalNormSGD(torch.optim.Optimizer):
    """SGD on gradients scaled to a global norm of at most 1, its steps counted in each group (as
    LAMB and LARS implementations do): an update that reads every parameter's gradient and the group."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr, "step": 0})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        scale = min(1.0, 1.0 / (torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item() + 1e-12))
        for group in self.param_groups:
            group["step"] += 1
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.add_(parameter.grad, alpha=-group["lr"] * scale / group["step"] ** 0.5)


def optimizers(kind: str, parameters):
    if kind == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer  # (its import warns: in the ranks alone)

        return ZeroRedundancyOptimizer(parameters, torch.optim.Adam, lr=0.01)
    return GlobalNormSGD(parameters, lr=0.5) if kind == "global_norm" else torch.optim.Adam(parameters, lr=0.01)


def optimizer_beside_ddp(rank, world_size, kind):
    """4 steps of us_byte (its input-side updates deferred to the next forward with torch's own
    optimizers) with the optimizer `kind`, beside torch DDP with one: the most updates left
    pending after a step, and the distance to DDP's parameters."""
    torch.manual_seed(5)
    model = HeadFirst()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model, optimizer = gradsync.wrap(model, optimizers(kind, model.parameters()), scheduler="us_byte",
                                     profile=_profile(model), cost=COST, partition_bytes=256)
    ref_optimizer = optimizers(kind, reference.parameters())
    return most_pending_beside(model, optimizer, reference, ref_optimizer, rank, 4,
                               lambda _, stepper: stepper.zero_grad())


@pytest.mark.parametrize("kind", ["zero_redundancy", "global_norm", "torch_adam"])
def test_optimizers_other_than_torchs_own_wait_for_every_op_before_the_step(kind):
    """ZeroRedundancyOptimizer steps its shard of every parameter whatever its groups hold; a LAMB-like
    step reads the global norm and counts in the group: their updates are not deferred. torch's own
    optimizers' are."""
    for pending, apart in run_local(optimizer_beside_ddp, 2, kind):
        assert (pending > 0) == (kind == "torch_adam")
        assert apart < 1e-6


def averaged_copy_beside_ddp(rank, world_size, scheduler, options):
    """An AveragedModel (a deep copy) made of the model after the wrap, while its layers are timed
    (a measured profile), updated after each of 6 steps and run forward and backward, beside
    torch DDP with one: the distance of the model to DDP's, of the average to DDP's average, and
    the model's iterations (the copy's passes, carrying gradsync's hooks, must leave it alone)."""
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(5)
    model = HeadFirst()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5), scheduler=scheduler,
                                     cost=COST, **options)
    average, reference_average = AveragedModel(model), AveragedModel(reference.module)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(6):
        tokens, targets = batch(rank, step)
        for network, stepper, averaged in ((model, optimizer, average), (reference, ref_optimizer, reference_average)):
            stepper.zero_grad()
            F.cross_entropy(network(tokens), targets).backward()
            stepper.step()
            # (model.parameters() applies the updates deferred to the next forward first)
            averaged.update_parameters(network.module if network is reference else network)
            F.cross_entropy(averaged(tokens), targets).backward()  # a teacher's loss, on the copy's own gradients
            averaged.zero_grad()
    apart, averages_apart = distance(model, reference), distance(average.module, reference_average.module)
    iterations = attached(model).report().iteration
    attached(model).detach()
    return apart, averages_apart, iterations


def test_a_hook_on_a_module_does_nothing_on_its_copies():
    calls = []
    module = nn.Linear(2, 2)
    module.register_forward_pre_hook(on_module(module, lambda called_on, _inputs: calls.append(called_on)))
    copied = copy.deepcopy(module)
    copied(torch.zeros(1, 2))
    assert calls == []
    module(torch.zeros(1, 2))
    assert calls == [module]


@pytest.mark.parametrize("scheduler, options", [("ddp", {}), ("us_byte", {"partition_bytes": 256})])
def test_a_deep_copy_of_the_model_made_after_the_wrap_trains_nothing_of_it(scheduler, options):
    for apart, averages_apart, iterations in run_local(averaged_copy_beside_ddp, 2, scheduler, options):
        assert apart < 1e-6 and averages_apart < 1e-6
        assert iterations == 6  # the model's own; no pass through the copy counted as one


def _half_and_bfloat():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].half()
    model[2].bfloat16()
    return model


def test_dtypes_of_one_element_size_are_refused_before_any_collective():
    """torch.distributed is not initialised here: the error comes before wrap would need it."""
    model = _half_and_bfloat()
    named = r"torch\.bfloat16 \(e\.g\. '2\.weight'\), torch\.float16 \(e\.g\. '0\.weight'\)"
    with pytest.raises(ConfigError, match=named):
        gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp")
    assert model not in engine._ATTACHED


@pytest.mark.parametrize("compressor", ["acp_sgd", "powersgd", "signsgd", "topk"])
def test_complex_parameters_are_refused_with_a_compressor_before_any_collective(compressor):
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(ConfigError, match=rf"compressor '{compressor}' works on real gradients; parameter\(s\) \['weight'\]"):
        gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp", compressor=compressor)
    assert model not in engine._ATTACHED


def test_dtypes_of_different_element_sizes_are_accepted():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).half(), nn.Linear(2, 2).double())
    assert len(ParameterTable.of(model).parameters) == 6


def a_failed_wrap_leaves_the_model_free(rank, world_size):
    """A wrap failing after its hooks are attached (each rank's profile has other times, so mg_wfbp
    merges differently: plan hash mismatch) detaches them: a plain backward runs, and the model can
    be wrapped again and trains like DDP. Returns the error, whether the model is left attached, and
    the distance to DDP."""
    torch.manual_seed(0)
    model = TiedNet()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    try:
        profile = synthetic_profile(model).scaled(1e-3 if rank else 1.0)  # one op on rank 1, seven on rank 0
        gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="mg_wfbp", profile=profile,
                      cost=COST)
        error = None
    except ConfigError as failure:
        error = str(failure)
    left_attached = model in engine._ATTACHED
    tokens, targets = batch(rank, 0)
    F.cross_entropy(model(tokens), targets).backward()  # no hook of the failed wrap fires
    model.zero_grad()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                     profile=synthetic_profile(model), cost=COST)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    train_side_by_side(((model, optimizer), (reference, ref_optimizer)), rank, 2)
    apart = distance(model, reference)
    attached(model).detach()
    return error, left_attached, apart


def test_a_wrap_that_fails_after_attaching_detaches():
    for error, left_attached, distance in run_local(a_failed_wrap_leaves_the_model_free, 2):
        assert error is not None and "plan hash mismatch" in error
        assert not left_attached
        assert distance < 1e-6


def wrap_with_rank_dependent(rank, world_size, settings):
    """wrap with settings[rank] on each rank: the error each rank raises, if any."""
    torch.manual_seed(0)
    model = TiedNet()
    try:
        gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), profile=synthetic_profile(model), cost=COST,
                      **settings[rank])
    except ConfigError as failure:
        return str(failure), model in engine._ATTACHED
    attached(model).detach()
    return None, False


@pytest.mark.parametrize("settings, named", [
    # codec options: a differing seed or reuse trains without error but the replicas drift apart
    ([{"compressor": {"type": "acp_sgd", "seed": 1}}, {"compressor": {"type": "acp_sgd", "seed": 2}}],
     "compressor options: rank 1 has {'rank': 4, 'min_compression_rate': 2.0, 'start_iter': 0, "
     "'error_feedback': True, 'reuse': True, 'seed': 2, 'wire_dtype': None}"),
    ([{"compressor": {"type": "acp_sgd", "reuse": False}}, {"compressor": "acp_sgd"}], "'compressor options'"),
    ([{"compressor": {"type": "topk", "density": 0.1}}, {"compressor": "topk"}], "'compressor options'"),
    # planner options
    ([{"scheduler": "us_byte", "partition_bytes": 1024}, {"scheduler": "us_byte"}], "'scheduler options'"),
])
def test_ranks_whose_codec_or_planner_options_differ_fail_naming_them(settings, named):
    for error, left_attached in run_local(wrap_with_rank_dependent, 2, settings):
        assert error is not None and named in error and "(ranks [1] differ from rank 0)" in error, error
        assert not left_attached


def wrap_a_rank_dependent_model(rank, world_size, change):
    """wrap on each rank, rank 1's model changed by `change`: the error, or None."""
    torch.manual_seed(0)
    model = TiedNet()
    if rank == 1:
        model = {"double": lambda m: m.double(),
                 "shape": lambda m: setattr(m, "mix", torch.nn.Linear(WIDTH, WIDTH + 1)) or m,
                 "extra": lambda m: setattr(m, "extra", torch.nn.Linear(2, 2)) or m,
                 "frozen": lambda m: m.mix.requires_grad_(False) and m}[change](model)
    try:
        gradsync.wrap(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                      profile="measure", cost=COST, timeout=60)
    except ConfigError as failure:
        return str(failure)
    attached(model).detach()
    return None


@pytest.mark.parametrize("change, named", [
    ("double", "parameter 'conv.bias': rank 1 has ((16,), 'float64', 'cpu', True), rank 0 has ((16,), 'float32', "
               "'cpu', True)"),
    ("shape", "parameter 'mix.weight'"),
    ("extra", "'parameter names'"),
    ("frozen", "parameter 'mix.bias': rank 1 has ((16,), 'float32', 'cpu', False)"),
])
def test_ranks_whose_models_differ_fail_naming_the_tensor_before_any_collective(change, named):
    """torch DDP compares parameter shapes across ranks first; gradsync compares names, shapes,
    dtypes, devices and requires_grad of parameters and buffers (a float64 model on one rank used
    to abort its peer inside gloo)."""
    for error in run_local(wrap_a_rank_dependent_model, 2, change, timeout=120):
        assert error is not None and named in error and "different" in error, error


def test_ranks_wrapping_with_different_settings_fail_naming_them():
    """Different channels or buffer broadcasts would make the ranks' collectives differ (a hang, or
    a store timeout deep in the process group): every rank refuses first, naming what differs."""
    settings = [{"scheduler": "wfbp", "channels": 2}, {"scheduler": "wfbp", "channels": 1, "broadcast_buffers": False}]
    for error, left_attached in run_local(wrap_with_rank_dependent, 2, settings):
        assert error is not None and "different ['broadcast_buffers', 'channels'] on different ranks" in error
        assert not left_attached
    same = [{"scheduler": "wfbp", "channels": 2, "trace": None}, {"scheduler": "wfbp", "channels": 2}]
    assert run_local(wrap_with_rank_dependent, 2, same) == [(None, False)] * 2


STALL_TIMEOUT = 2.0  # wrap's timeout in the stall tests (seconds)
STALL = STALL_TIMEOUT + 3.0  # how long the stalled rank sleeps at most: its peer gives up first


def stall(released: str) -> None:
    """Sleep STALL seconds, or until the file `released` exists (the peer has failed: the wait
    has outlasted its timeout, and sleeping on only makes the test slower)."""
    import time

    deadline = time.monotonic() + STALL
    while time.monotonic() < deadline and not os.path.exists(released):
        time.sleep(0.02)


def stalled_peer(rank, world_size, where, released):
    """Rank 1 stalls (sleeps past wrap's timeout) at `where` (STALL_POINTS); rank 0 returns the
    error it gets and how long after the start of wrap or of the iteration it came, and then
    creates the file `released`, which ends rank 1's stall."""
    import time

    from gradsync import runtime
    from gradsync.runtime import installed
    from gradsync.runtime.measure import calibration, trials
    from gradsync.runtime.over_ranks import PendingReduction

    def stalling(function):
        def stalled(*args, **kwargs):
            stall(released)
            return function(*args, **kwargs)
        return stalled

    modules = {"runtime": runtime, "engine": engine, "installed": installed, "calibration": calibration,
               "trials": trials, "PlanTrials": trials.PlanTrials, "PendingReduction": PendingReduction,
               "GradSync": engine.GradSync}
    module, attribute, options = STALL_POINTS[where]
    if rank == 1 and module is not None:
        setattr(modules[module], attribute, stalling(getattr(modules[module], attribute)))
    torch.manual_seed(0)
    model = TiedNet()
    arrived = time.monotonic()
    try:
        if where == "wrap" and rank == 1:
            stall(released)
            if os.path.exists(released):  # the peer has given up on wrap: nobody left to meet there
                return None, None, 0.0
        settings = {"scheduler": "wfbp", "profile": synthetic_profile(model), "cost": COST, **options}
        model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), timeout=STALL_TIMEOUT,
                                         warmup_iterations=0, measure_iterations=1, **settings)
        for step in range(60):
            arrived = time.monotonic()
            optimizer.zero_grad()
            tokens, targets = batch(rank, step)
            F.cross_entropy(model(tokens), targets).backward()
            optimizer.step()
        if rank == 1 and where == "state_dict":
            torch.distributed.all_gather_object = stalling(torch.distributed.all_gather_object)
        arrived = time.monotonic()
        optimizer.state_dict()
    except RuntimeError as failure:
        seconds = time.monotonic() - arrived
        open(released, "w").close()
        return type(failure).__name__, str(failure), seconds
    return None, None, time.monotonic() - arrived


# where rank 1 stalls: (module, function delayed there, wrap options), and the collective named
STALL_POINTS = {
    "wrap": (None, None, {}),
    "settings": ("runtime", "check_same_settings", {}),
    "parameters": ("runtime", "broadcast_from_first", {}),
    "seed": ("runtime", "share_from_first", {}),
    "plan hash": ("installed", "check_same_on_all_ranks", {}),
    "probes": ("runtime", "measure_cost", {"cost": "measure"}),
    "layer times": ("calibration", "gather_from_all", {"profile": "measure"}),
    "trials": ("PlanTrials", "_end_round", {"scheduler": "auto", "profile": "measure"}),
    "buffers": ("GradSync", "_start_buffers_broadcast", {}),
    # a watcher's reduction over the ranks (the compute speed's, after 8 iterations) is read an
    # iteration later: the peer is missed first at that iteration's first collective, here the
    # gradients' communication (the buffers are not broadcast) and else the buffers' broadcast
    "watchers": ("PendingReduction", "start", {"broadcast_buffers": False}),
    "watchers, buffers": ("PendingReduction", "start", {}),
    "state_dict": (None, None, {"compressor": "acp_sgd"}),
}
NAMED = {"wrap": "the start of gradsync.wrap", "settings": "the settings check of gradsync.wrap",
         "parameters": "the broadcast of rank 0's parameters and buffers at gradsync.wrap",
         "seed": "the codec's seed at gradsync.wrap", "plan hash": "the plan hash check",
         "probes": "the network probes at gradsync.wrap", "layer times": "the gather of the ranks' layer times",
         "trials": "the plan trials' result", "buffers": "the broadcast of rank 0's buffers in the backward pass",
         "watchers": "the gradients' communication (op",
         "watchers, buffers": "the broadcast of rank 0's buffers in the backward pass",
         "state_dict": "state_dict's gather of every rank's error feedback"}


@pytest.mark.parametrize("where", list(STALL_POINTS))
def test_a_peer_stalled_at_a_collective_fails_the_other_within_the_timeout_naming_it(where, tmp_path):
    reports = run_local(stalled_peer, 2, where, str(tmp_path / "released"), return_errors=True, timeout=120)
    status, (kind, message, seconds) = reports[0]
    assert status == "ok" and kind == "PeersTimedOut", reports[0]
    assert NAMED[where] in message and f"within the timeout of {STALL_TIMEOUT:g} s" in message, message
    assert seconds < STALL_TIMEOUT + 5


def test_the_survivor_of_a_killed_peer_exits_within_the_timeout_after_its_error():
    """Rank 1 is killed (SIGKILL) mid-training, each rank its own process as under torchrun: rank 0
    raises, and its process is gone within the timeout of that error."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from gradsync.launch import free_port

    timeout = 5.0
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "GLOO_SOCKET_IFNAME": "lo"}
    job = str(Path(__file__).with_name("killed_peer_job.py"))
    ranks = [subprocess.Popen([sys.executable, job, str(timeout)], env={**env, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    output, errors = ranks[0].communicate(timeout=120)
    exited = time.time()
    ranks[1].wait(timeout=60)
    assert ranks[1].returncode == -9 and ranks[0].returncode == 3, (output[-500:], errors[-2000:])
    failed_at = float(output.split("error at ")[1].split(":")[0])
    assert exited - failed_at < timeout, (exited - failed_at)


def test_channels_a_framework_never_releases_are_released_at_exit():
    """Each rank its own process, ending with gradsync attached and no teardown at all: gradsync's
    exit handler releases its channel groups while torch.distributed is still up, and both ranks
    exit cleanly."""
    import subprocess
    import sys
    from pathlib import Path

    from gradsync.launch import free_port

    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "GLOO_SOCKET_IFNAME": "lo"}
    job = str(Path(__file__).with_name("exit_without_teardown_job.py"))
    ranks = [subprocess.Popen([sys.executable, job], env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for process in ranks:
        output, errors = process.communicate(timeout=120)
        assert process.returncode == 0, errors[-2000:]
        assert "trained: 2 channel group(s)" in output
        assert "left: 0 channel group(s); default group up: True" in output, (output, errors[-2000:])


class ThreeLayers(nn.Module):
    """Three linear layers; `loss` computes the training loss through them without the model's own
    forward (as models whose training step is a method do); `forward(x, direct=True)` reads the last
    layer's parameters directly instead of running that layer."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, inputs, direct: bool = False):
        hidden = torch.tanh(self.middle(torch.tanh(self.first(inputs))))
        return F.linear(hidden, self.last.weight, self.last.bias) if direct else self.last(hidden)

    def loss(self, inputs, targets):
        return F.cross_entropy(self.last(torch.tanh(self.middle(torch.tanh(self.first(inputs))))), targets)


def deferred_beside_averaged_by_hand(rank, world_size, case: str):
    """6 steps of momentum SGD with every update deferred to its layer's next forward (wfbp with
    overlap_forward), beside a copy whose gradients are averaged by hand: "pruned", the middle layer
    pruned (its weight computed from the parameters by a forward pre-hook registered before the
    wrap); "method", the loss computed by a method of the model; "direct", the last layer's
    parameters read directly by the model's forward on the odd steps. The distance to the copy, or
    the error."""
    def made():
        torch.manual_seed(3)
        network = ThreeLayers()
        if case == "pruned":  # (a pruned module cannot be deep-copied: made twice alike)
            torch.nn.utils.prune.l1_unstructured(network.middle, "weight", amount=0.25)
        return network

    model, reference = made(), made()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    table = ParameterTable.of(model)
    profile = table.profile("three", ["first", "middle", "last"], dict.fromkeys(table.owners, 1e-3),
                            dict.fromkeys(table.owners, 2e-3))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                     scheduler="wfbp", overlap_forward=True, profile=profile, cost=COST)

    def loss(network, step):
        generator = torch.Generator().manual_seed(100 * rank + step)
        inputs, targets = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
        if case == "method":
            return network.loss(inputs, targets)
        return F.cross_entropy(network(inputs, direct=case == "direct" and step % 2 == 1), targets)

    def train():
        for step in range(6):
            optimizer.zero_grad()
            loss(model, step).backward()
            optimizer.step()
            ref_optimizer.zero_grad()
            loss(reference, step).backward()
            for parameter in reference.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= world_size
            ref_optimizer.step()

    return distance_or_error(train, model, optimizer, reference)


@pytest.mark.parametrize("case", ["pruned", "method"])
def test_deferred_updates_land_before_pre_hooks_and_without_the_models_forward(case):
    """The update runs before the module's other pre-forward hooks (pruning's mask, the older
    weight_norm and spectral_norm compute the weight from the parameters there), and its hook is
    in place from the step on, for layers run by a method of the model rather than its forward."""
    assert run_local(deferred_beside_averaged_by_hand, 2, case) == [pytest.approx(0, abs=1e-6)] * 2


def test_parameters_read_before_their_deferred_update_are_refused():
    """The forward read the last layer's parameters without running it, before its update: refused as
    the backward pass begins, before the update lands in place under the pass."""
    for error in run_local(deferred_beside_averaged_by_hand, 2, "direct"):
        assert "the forward read parameter(s) ['last.weight', 'last.bias'] before their update" in error

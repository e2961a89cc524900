"""The runtime gives exactly torch DDP's gradients and training trajectory, for every scheduler."""
import copy

import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync import planners
from gradsync.runtime import attached
from gradsync.launch import run_local
from runtime_models import COST, AttentionNet, TiedNet, batch, distance, synthetic_profile, train_side_by_side

SMALL_BLOCKS = {"bytescheduler": {"partition_bytes": 256}, "us_byte": {"partition_bytes": 256}}
SCHEDULERS = [n for n in planners.names()]
# TiedNet's 14 parameters less the frozen layer's two and the unused layer's two (the head's weight is
# the embedding's)
TRAINED_PARAMETERS = 10


def _models(seed: int = 0):
    torch.manual_seed(seed)
    model = TiedNet()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    return model, reference


def _loss(model, rank, step):
    tokens, targets = batch(rank, step)
    return F.cross_entropy(model(tokens, use_rank0_branch=rank == 0), targets)


def _grads(model):
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def gradients_match_ddp(rank, world_size, schedulers=tuple(SCHEDULERS), transport=None):
    """One backward per scheduler; every gradient equals DDP's (None where DDP's is None).
    `transport`: wrap's transport options (default: the backend's all-reduce)."""
    mismatches = []
    for name in schedulers:
        model, reference = _models()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = gradsync.wrap(model, optimizer, scheduler=name, profile=synthetic_profile(model),
                                         cost=COST, **SMALL_BLOCKS.get(name, {}), **(transport or {}))
        _loss(model, rank, 0).backward()
        optimizer.synchronize()
        _loss(reference, rank, 0).backward()
        ours, theirs = _grads(model), _grads(reference.module)
        for key in theirs:
            if (ours[key] is None) != (theirs[key] is None):
                mismatches.append(f"{name}: {key} None-ness differs")
            elif ours[key] is not None and not torch.allclose(ours[key], theirs[key], rtol=1e-6, atol=1e-7):
                mismatches.append(f"{name}: {key} differs by {(ours[key] - theirs[key]).abs().max():.3g}")
        attached(model).detach()
    return mismatches


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_scheduler_gives_ddp_gradients(world_size):
    for mismatches in run_local(gradients_match_ddp, world_size):
        assert mismatches == []


def test_forest_transport_gives_ddp_gradients():
    """Ops carried by the forest trees of a 3-ring: backward-phase, two-channel and forward-phase plans."""
    forest = {"transport": "forest", "topology": "ring-3"}
    for mismatches in run_local(gradients_match_ddp, 3, ("wfbp", "asc_wfbp", "us_byte"), forest):
        assert mismatches == []


def training_matches_ddp(rank, world_size, schedulers, optimizer_name, set_to_none=True):
    """20 steps with the given optimizer, gradients zeroed by `zero_grad(set_to_none)`; per
    scheduler, the distance to DDP's final parameters and how many gradients are spans of op buffers."""
    make = {
        "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
        "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    }[optimizer_name]
    errors = {}
    for name in schedulers:
        model, reference = _models(seed=1)
        model, optimizer = gradsync.wrap(model, make(model.parameters()), scheduler=name,
                                         profile=synthetic_profile(model), cost=COST, **SMALL_BLOCKS.get(name, {}))
        ref_optimizer = make(reference.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_optimizer, step_size=5, gamma=0.5)
        for step in range(20):
            optimizer.zero_grad(set_to_none=set_to_none)
            _loss(model, rank, step).backward()
            optimizer.step()
            scheduler.step()
            ref_optimizer.zero_grad(set_to_none=set_to_none)
            _loss(reference, rank, step).backward()
            ref_optimizer.step()
            ref_scheduler.step()
        optimizer.synchronize()
        buffers = {op.buffer.untyped_storage().data_ptr() for executor in attached(model).installed.executors.values()
                   for op in executor.ops}
        in_buffers = sum(p.grad is not None and p.grad.untyped_storage().data_ptr() in buffers
                         for p in model.parameters())
        errors[name] = (max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())),
                        in_buffers)
        attached(model).detach()
    return errors


@pytest.mark.parametrize("optimizer_name, set_to_none", [("sgd", True), ("adamw", True), ("sgd", False)])
def test_twenty_steps_reach_ddp_parameters(optimizer_name, set_to_none):
    """With set_to_none=False the gradients that live in op buffers are zeroed and accumulated there."""
    for errors in run_local(training_matches_ddp, 2, SCHEDULERS, optimizer_name, set_to_none):
        assert errors and max(error for error, _ in errors.values()) < 1e-5, errors
        # uncompressed tensors carried whole by one op become spans of its buffer, not copies;
        # bytescheduler's 256-byte blocks split the weights over several ops, so only biases are spans
        assert errors["wfbp"][1] == errors["ddp"][1] == TRAINED_PARAMETERS, errors
        assert 0 < errors["bytescheduler"][1] < TRAINED_PARAMETERS, errors


def attention_trains_like_ddp(rank, world_size, schedulers):
    """Forward-phase plans defer updates into the next forward; nn.MultiheadAttention's out_proj
    never runs its own forward, yet its weight must be updated before the attention uses it."""
    errors = {}
    for name in schedulers:
        torch.manual_seed(2)
        model = AttentionNet()
        reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=name,
                                         cost=COST, **SMALL_BLOCKS.get(name, {}))
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        train_side_by_side(((model, optimizer), (reference, ref_optimizer)), rank, 8)
        optimizer.synchronize()
        sync = attached(model)
        errors[name] = (distance(model, reference),
                        sum(op.phase != "backward" for plan in sync.installed.plans.values() for op in plan.ops))
        sync.detach()
    return errors


def test_deferred_updates_reach_parameters_read_without_their_modules_forward():
    for errors in run_local(attention_trains_like_ddp, 2, ("us_byte", "bytescheduler")):
        for name, (error, forward_ops) in errors.items():
            assert forward_ops > 0, name  # the plan does defer updates into the next forward
            assert error < 1e-5, (name, error)


def deferred_waits_train_like_ddp(rank, world_size, schedulers):
    """With ``overlap_forward`` the step waits for no op: every module's update is deferred into
    the next forward (with the learning rate of the step that owed it), the modules whose ops are
    done updated together, and the parameters still follow DDP's. Per scheduler: the distance to
    DDP, the fewest modules left pending by a step, the modules, the most optimizer calls in an
    iteration and the plan's ops."""
    results = {}
    for name in schedulers:
        model, reference = _models(seed=3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = gradsync.wrap(model, optimizer, scheduler=name, profile=synthetic_profile(model),
                                         cost=COST, overlap_forward=True)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (optimizer, ref_optimizer)]
        sync, fewest_pending, calls, most_calls = attached(model), None, [0], 0
        optimizer.register_step_post_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))  # the wrapped one's
        for step in range(10):
            optimizer.zero_grad(set_to_none=False)
            most_calls, calls[0] = max(most_calls, calls[0]), 0
            _loss(model, rank, step).backward()
            optimizer.step()
            pending = len(sync.deferred.pending)
            fewest_pending = pending if fewest_pending is None else min(fewest_pending, pending)
            ref_optimizer.zero_grad(set_to_none=False)
            _loss(reference, rank, step).backward()
            ref_optimizer.step()
            for schedule in schedules:
                schedule.step()
        optimizer.synchronize()
        results[name] = (max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())),
                         fewest_pending, len(sync.table.owners), most_calls, len(sync.plan.ops))
        sync.detach()
    return results


def test_deferred_waits_leave_every_update_to_the_next_forward_and_train_like_ddp():
    for results in run_local(deferred_waits_train_like_ddp, 2, ("optimal_merge", "asc_wfbp")):
        for name, (error, fewest_pending, owners, most_calls, ops) in results.items():
            assert fewest_pending == owners, (name, fewest_pending, owners)
            assert 1 <= most_calls <= ops, (name, most_calls, ops)  # one call per module would be `owners`
            assert error < 1e-5, (name, error)
        assert results["optimal_merge"][4] < results["optimal_merge"][2]  # its ops carry several modules


def state_dicts_hold_the_deferred_updates(rank, world_size):
    """With every update deferred into the next forward: the model's state_dict() after a step
    holds DDP's weights, and a load_state_dict() in that state is not overwritten by the update
    the step owed. Returns the distance to DDP and to the loaded weights, and the pending modules."""
    model, reference = _models(seed=4)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     scheduler="optimal_merge", profile=synthetic_profile(model), cost=COST,
                                     overlap_forward=True)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        for net, opt in ((model, optimizer), (reference, ref_optimizer)):
            opt.zero_grad()
            _loss(net, rank, step).backward()
            opt.step()
    pending_after_step = len(attached(model).deferred.pending)
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    to_ddp = max((saved[name] - q).abs().max().item()
                 for (name, _), q in zip(model.named_parameters(), reference.parameters()))
    optimizer.zero_grad()
    _loss(model, rank, 3).backward()
    optimizer.step()  # owes another update
    model.load_state_dict(saved)
    with torch.no_grad():
        model(batch(rank, 4)[0], use_rank0_branch=rank == 0)  # a forward applies what is still owed
    to_loaded = max((saved[name] - p).abs().max().item() for name, p in model.named_parameters())
    attached(model).detach()
    return pending_after_step, to_ddp, to_loaded


def test_state_dicts_apply_deferred_updates_first():
    for pending, to_ddp, to_loaded in run_local(state_dicts_hold_the_deferred_updates, 2):
        assert pending > 0  # the step did leave updates to the next forward
        assert to_ddp < 1e-5
        assert to_loaded == 0


def channels_last_trains_like_ddp(rank, world_size):
    """A convolution whose weight is channels_last (not contiguous) next to contiguous parameters:
    the contiguous ones' gradients become spans of the op buffer, the convolution's is copied,
    and every step's gradients equal DDP's."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 5))
    model[0].to(memory_format=torch.channels_last)
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="ddp", cost=COST)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    largest, spans = 0.0, []
    for _ in range(3):
        images = torch.randn(2, 3, 6, 6, generator=generator).to(memory_format=torch.channels_last)
        for net, opt in ((model, optimizer), (reference, ref_optimizer)):
            opt.zero_grad()
            net(images).square().mean().backward()
        optimizer.synchronize()
        largest = max(largest, max((p.grad - q.grad).abs().max().item()
                                   for p, q in zip(model.parameters(), reference.module.parameters())))
        buffers = {op.buffer.untyped_storage().data_ptr() for op in attached(model).executor.ops}
        spans.append([p.grad.untyped_storage().data_ptr() in buffers for p in model.parameters()])
        optimizer.step()
        ref_optimizer.step()
    attached(model).detach()
    return largest, spans


def test_a_channels_last_weight_is_copied_and_the_rest_adopted():
    for largest, spans in run_local(channels_last_trains_like_ddp, 2):
        assert largest < 1e-6
        assert spans == [[False, True, True, True]] * 3


def packing_at_once_and_slice_by_slice_agree(rank, world_size):
    """Per scheduler, three steps with every op packed at once (its gradients copied together, its
    data scaled in one pass) and with every slice packed alone: per step, each way's largest
    difference from torch DDP's gradients, the two ways' gradients, and which ops each packed at once."""
    from gradsync.runtime import executor as executor_module

    default = executor_module.FUSED_PACK_MEAN_BYTES
    results = {}
    try:
        for scheduler in ("ddp", "wfbp"):
            for mean_bytes in (10**9, 0):
                executor_module.FUSED_PACK_MEAN_BYTES = mean_bytes
                torch.manual_seed(5)
                model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
                reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
                model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                                 scheduler=scheduler, cost=COST)
                ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
                generator = torch.Generator().manual_seed(rank)
                steps = []
                for _ in range(3):
                    inputs = torch.randn(4, 6, generator=generator)
                    for net, opt in ((model, optimizer), (reference, ref_optimizer)):
                        opt.zero_grad()
                        net(inputs).square().mean().backward()
                    optimizer.synchronize()
                    steps.append((max((p.grad - q.grad).abs().max().item()
                                      for p, q in zip(model.parameters(), reference.module.parameters())),
                                  [p.grad.clone() for p in model.parameters()]))
                    optimizer.step()
                    ref_optimizer.step()
                at_once = [op.fused_data is not None for op in attached(model).executor.ops]
                attached(model).detach()
                results[scheduler, mean_bytes] = steps, at_once
    finally:
        executor_module.FUSED_PACK_MEAN_BYTES = default
    return results


def test_packing_an_op_at_once_gives_the_bits_of_packing_it_slice_by_slice():
    for results in run_local(packing_at_once_and_slice_by_slice_agree, 2):
        for scheduler in ("ddp", "wfbp"):
            (fused_steps, fused_ops), (sliced_steps, sliced_ops) = results[scheduler, 10**9], results[scheduler, 0]
            assert fused_ops and all(fused_ops) and not any(sliced_ops)
            for (fused_gap, fused_grads), (sliced_gap, sliced_grads) in zip(fused_steps, sliced_steps):
                assert fused_gap < 1e-6 and sliced_gap < 1e-6
                assert all(torch.equal(a, b) for a, b in zip(fused_grads, sliced_grads))

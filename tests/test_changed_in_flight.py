"""Gradients changed while their ops are in flight (clipped, or unscaled by a GradScaler, before
``optimizer.synchronize()``) are refused at the step, before any op is collected, in every mode the
runtime runs: the averages would overwrite the change, a silent wrong step. The iterations here begin at each
parameter's gradient (the first ones, and the plans that keep those hooks); ``test_output_start``
covers the iterations begun at the model's outputs."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync import GradientsChangedInFlight
from gradsync.launch import run_local
from gradsync.runtime import attached
from runtime_models import COST
from test_output_start import Chain, chain_profile

# (scheduler, options): what the plan's ops carry
PLANS = {
    "one_fused_op": ("ddp", {}),
    "an_op_a_layer": ("wfbp", {}),
    "tensors_split_over_several_ops": ("bytescheduler", {"partition_bytes": 256}),
    "compressed_in_one_round": ("wfbp", {"compressor": {"type": "acp_sgd", "rank": 2, "start_iter": 0}}),
    "compressed_in_two_rounds": ("wfbp", {"compressor": {"type": "powersgd", "rank": 2, "start_iter": 0}}),
    "waits_deferred_to_the_next_forward": ("us_byte", {"overlap_forward": True}),
}
# (ByteScheduler's blocks sent after the backward pass are waited for at the next forward)
DEFERRED = ("tensors_split_over_several_ops", "waits_deferred_to_the_next_forward")
# the first iteration begins at each parameter's gradient under every plan, and its gradients are
# copied into the buffers; a later one begins at the outputs where the plan lets it, its gradients
# the buffer's spans in the one fused op (``test_output_start`` covers the refusals particular to it)
STEPS = ["clipped", "plain", "plain", "plain", "clipped", "plain", "plain"]


def steps_with_clipped_ones(rank: int, world_size: int, scheduler: str, options: dict, device: str = "cpu") -> dict:
    """Per step of `STEPS`: whether it began at the outputs, the refusal it raised (None), and
    whether its update changed the parameters (deferred updates included: compared just before the
    next step's); a refused step is followed by ``optimizer.zero_grad()``, as the message asks. Also
    the shape of the plan: tensors split, waits deferred, rounds a step, ops a round."""
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.set_device(0)
    model = Chain().to(device)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=scheduler,
                                     profile=chain_profile(model), cost=COST, **options)
    sync = attached(model)
    record, before_steps = [], []
    for step, kind in enumerate(STEPS):
        generator = torch.Generator().manual_seed(100 * rank + step)
        inputs, targets = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
        inputs, targets = inputs.to(device), targets.to(device)
        at_outputs, error = sync.begins_at_outputs, None
        optimizer.zero_grad()
        F.cross_entropy(model(inputs)["logits"], targets).backward()
        if kind == "clipped":  # without optimizer.synchronize(): the local gradients, in flight
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        before_steps.append([parameter.detach().clone() for parameter in model.parameters()])
        try:
            optimizer.step()
        except GradientsChangedInFlight as refused:
            error = str(refused)
        record.append([at_outputs, error])
    sync.flush()
    before_steps.append(list(model.parameters()))
    for entry, before, after in zip(record, before_steps, before_steps[1:]):
        entry.append(any(not torch.equal(b, a) for b, a in zip(before, after)))
    plans = sync.installed.plans.values()
    shape = {"split": any(len(ops) > 1 for ops in sync.executor.ops_of_tensor.values()),
             "deferred": any(op.gates_forward for plan in plans for op in plan.ops),
             "rounds": len(sync.rounds_now), "ops": len(sync.executor.ops)}
    sync.detach()
    return {"steps": record, **shape}


@pytest.mark.parametrize("plan", PLANS)
def test_gradients_clipped_before_synchronize_are_refused_and_training_goes_on(plan):
    """Refused at the step, before any op is collected: the step changes no parameter (a deferred
    update included), and the steps after it train."""
    scheduler, options = PLANS[plan]
    first, second = run_local(steps_with_clipped_ones, 2, scheduler, options, timeout=120)
    assert first["steps"] == second["steps"]
    check_refusals(first["steps"], plan)
    assert (first["split"], first["deferred"], first["rounds"], first["ops"] == 1) == (
        plan == "tensors_split_over_several_ops", plan in DEFERRED,
        2 if plan == "compressed_in_two_rounds" else 1, plan == "one_fused_op")


def check_refusals(record: list, plan: str) -> None:
    """Each clipped step refused, with the message of the mode it began in, and no parameter
    changed by it; every other step trained."""
    at_outputs = [at for at, _, _ in record]
    later = STEPS.index("clipped", 1)  # refused at the outputs, where the plan lets them begin: hooks from then on
    assert not any(at_outputs[:1] + at_outputs[later + 1:])
    assert at_outputs[later] == (plan in ("one_fused_op", "an_op_a_layer"))
    for step, (at_outputs, error, changed) in enumerate(record):
        if STEPS[step] == "clipped":
            assert "optimizer.synchronize()" in error and not changed, step
            assert ("accumulated into gradients being averaged" if at_outputs else "were changed before") in error
        else:
            assert error is None and changed, step


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["one_fused_op", "compressed_in_two_rounds", "waits_deferred_to_the_next_forward"])
def test_gradients_clipped_before_synchronize_are_refused_on_cuda_over_nccl(plan):
    """NCCL writes the op buffers without moving their version counters, nor those of the
    gradients that are their views: only the clipping shows."""
    scheduler, options = PLANS[plan]
    result, = run_local(steps_with_clipped_ones, 1, scheduler, options, "cuda", backend="nccl", timeout=300)
    check_refusals(result["steps"], plan)


def cleared_by_hand_after_the_step(rank: int, world_size: int) -> dict:
    """Per deferring plan and way of clearing (``p.grad = None``, ``p.grad.zero_()``), steps whose
    gradients are cleared by hand at the loop's top while some updates wait for their layer's next
    forward (through a list of the parameters taken before the loop: ``model.parameters()`` would
    apply those updates first): the refusal, the updates still pending then, and whether the replicas
    still agree."""
    results = {}
    for plan, how in itertools.product(DEFERRED, ("none", "zero_")):
        scheduler, options = PLANS[plan]
        torch.manual_seed(0)
        model = Chain()
        model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=scheduler,
                                         profile=chain_profile(model), cost=COST, **options)
        sync, error, pending = attached(model), None, 0
        parameters = list(model.parameters())
        try:
            for step in range(4):
                for parameter in parameters:
                    if how == "none":
                        parameter.grad = None
                    elif parameter.grad is not None:
                        parameter.grad.zero_()
                pending = len(sync.deferred.pending)
                generator = torch.Generator().manual_seed(100 * rank + step)
                inputs, targets = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
                F.cross_entropy(model(inputs)["logits"], targets).backward()
                optimizer.step()
        except GradientsChangedInFlight as refused:
            error = str(refused)
        sync.detach()
        flat = torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, flat)
        results[f"{plan} {how}"] = {"error": error, "pending": pending,
                                    "replicas_agree": torch.equal(gathered[0], gathered[1])}
    return results


def test_gradients_cleared_by_hand_before_their_deferred_update_are_refused():
    """The deferred update needs the averages: clearing them by hand (not through zero_grad, which
    leaves them to it) is refused at the layer's next forward, before the update, on every rank.
    Set to None, they leave the averages in flight alike on every rank; zeroed in place, the writes
    may have reached buffers being reduced, which the message says."""
    for results in run_local(cleared_by_hand_after_the_step, 2, timeout=120):
        assert len(results) == 2 * len(DEFERRED)
        for case, result in results.items():
            assert result["pending"] > 0 and (result["replicas_agree"] or case.endswith("zero_")), case
            assert "changed after optimizer.step()" in result["error"] and "optimizer.zero_grad()" in result["error"]
            assert "resume from a checkpoint" in result["error"]

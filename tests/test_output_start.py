"""Iterations begun at the first gradient of the model's outputs (``runtime.output_start``): where
they begin, that they train as gradients averaged by hand, and what brings the per-parameter hooks
back (a parameter the autograd graph cannot see, a backward pass that bypasses the outputs)."""
import copy
import dataclasses
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradsync
from gradsync.launch import run_local
from gradsync.runtime import attached
from gradsync.runtime.parameter_table import ParameterTable
from runtime_models import COST, distance


class Chain(nn.Module):
    """Three small layers; the middle one optionally inside a reentrant checkpoint, whose
    parameters the outer backward pass's graph does not hold. Returns a dict, as many models do."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(8, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 4)

    def forward(self, inputs, checkpointed: bool = False):
        hidden = torch.tanh(self.first(inputs))
        hidden = checkpoint(self.middle, hidden, use_reentrant=True) if checkpointed else self.middle(hidden)
        return {"logits": self.last(torch.tanh(hidden)), "hidden": hidden}


def chain_profile(model: Chain):
    table = ParameterTable.of(model)
    order = ["first", "middle", "last"]
    return table.profile("chain", order, dict.fromkeys(order, 1e-3), dict.fromkeys(order, 2e-3))


def losses(network: nn.Module, kind: str, rank: int, step: int) -> list[torch.Tensor]:
    """The losses a step of `kind` runs backward on, in order (a no_sync step: two passes)."""
    generator = torch.Generator().manual_seed(100 * rank + step)
    inputs, targets = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
    device = network.first.weight.device
    inputs, targets = inputs.to(device), targets.to(device)

    def through_outputs(checkpointed=False):
        return F.cross_entropy(network(inputs, checkpointed)["logits"], targets)

    bypassing = network.middle.weight.square().sum  # the parameters alone: no output of the model's forward
    return {"plain": lambda: [through_outputs()], "checkpointed": lambda: [through_outputs(True)],
            "no_sync": lambda: [through_outputs(), through_outputs()],
            "bypass_after": lambda: [through_outputs(), bypassing()], "bypass_alone": lambda: [bypassing()],
            "bypass_after_synchronize": lambda: [through_outputs(), bypassing()],
            "clipped_in_flight": lambda: [through_outputs()]}[kind]()


def steps_beside_averaged_by_hand(rank: int, world_size: int, kinds: list[str], read_before_step: bool = False,
                                  device: str = "cpu", scheduler: str = "ddp", hidden: int = 16):
    """Per step: whether the iteration was to begin at the outputs, the error it raised (None), and
    the largest difference from a copy whose gradients are averaged by hand (all-reduced, over
    the default group) and that steps only where gradsync did; `read_before_step` as a front-end
    whose hooks read the gradients before the step (``wait_at_backward_end``); the model's layers
    `hidden` wide, synchronised by `scheduler`."""
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.set_device(0)
    model = Chain(hidden).to(device)
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=scheduler,
                                     profile=chain_profile(model), cost=COST)
    sync = attached(model)
    sync.wait_at_backward_end = read_before_step
    record = []
    for step, kind in enumerate(kinds):
        at_outputs, error = sync.begins_at_outputs, None
        optimizer.zero_grad()
        passes = losses(model, kind, rank, step)
        try:
            with gradsync.no_sync(model) if kind == "no_sync" else nullcontext():
                passes[0].backward()
            if kind == "bypass_after_synchronize":  # the gradients read before the step, as to clip them
                optimizer.synchronize()
            if kind == "clipped_in_flight":  # clipped without optimizer.synchronize(): local gradients, in flight
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            for loss in passes[1:]:
                loss.backward()
            optimizer.step()
        except RuntimeError as refused:
            error = str(refused)
            optimizer.zero_grad()
        else:
            reference_optimizer.zero_grad()
            for loss in losses(reference, kind, rank, step):
                loss.backward()
            for parameter in reference.parameters():
                if parameter.grad is not None:
                    dist.all_reduce(parameter.grad)
                    parameter.grad /= world_size
            reference_optimizer.step()
        record.append((at_outputs, error, distance(model, reference)))
    executors = sync.installed.executors.values()
    shape = {"launches_early": any(plan.tensors_launching_early() for plan in sync.installed.plans.values()),
             "all_fused": all(state.fused_data is not None for executor in executors for state in executor.ops)}
    sync.detach()
    return {"steps": record, **shape}


# (scheduler, layer width): one fused op launched at the backward pass's end; or one op a layer, each
# launched as its gradients are final, the middle layer's too large to be fused (its gradients are
# copied into the buffer, and a pass that bypasses the outputs writes them, not the buffer)
PLANS = {"one_fused_op_at_the_end": ("ddp", 16), "an_op_a_layer_launched_early_not_all_fused": ("wfbp", 128)}


def check_plan_shape(result: dict, plan: str) -> None:
    """The plan ran as `PLANS` describes it."""
    at_the_end = plan == "one_fused_op_at_the_end"
    assert (result["launches_early"], result["all_fused"]) == (not at_the_end, at_the_end)


def run_steps(kinds: list[str], read_before_step: bool = False, plan: str = "one_fused_op_at_the_end"):
    first, second = run_local(steps_beside_averaged_by_hand, 2, kinds, read_before_step, "cpu", *PLANS[plan],
                              timeout=120)
    check_plan_shape(first, plan)
    first, second = first["steps"], second["steps"]
    assert [(at, error is None) for at, error, _ in first] == [(at, error is None) for at, error, _ in second]
    return first


WARM = 6  # steps after which a plan of one op at the backward pass's end begins at the outputs


@pytest.mark.parametrize("plan", PLANS)
def test_a_plan_of_whole_gradients_begins_at_the_outputs_and_trains_as_averaged_by_hand(plan):
    record = run_steps(["plain"] * WARM + ["no_sync", "plain", "plain"], plan=plan)
    assert not record[0][0] and all(at for at, _, _ in record[WARM - 1:])
    assert all(error is None and difference < 1e-6 for _, error, difference in record)


def test_a_parameter_the_graph_cannot_see_brings_the_hooks_back_within_the_pass():
    """A reentrant checkpoint's inner pass reaches the middle layer: the graph at the outputs does
    not name it, so its gradient would be left out were the hooks not back for the rest of the pass."""
    record = run_steps(["plain"] * WARM + ["checkpointed", "checkpointed", "plain"])
    assert record[WARM][0] and not any(at for at, _, _ in record[WARM + 1:])
    assert all(error is None and difference < 1e-6 for _, error, difference in record)


@pytest.mark.parametrize("kind, read_before_step", [("checkpointed", False), ("plain", True)])
def test_the_hooks_stay_where_the_graph_never_names_every_parameter_or_a_front_end_reads_gradients(
        kind, read_before_step):
    record = run_steps([kind] * (WARM + 2), read_before_step)
    assert not any(at for at, _, _ in record)
    assert all(error is None and difference < 1e-6 for _, error, difference in record)


@pytest.mark.parametrize("kind, refusal, plan", [
    ("bypass_after", "accumulated into gradients being averaged", "one_fused_op_at_the_end"),
    ("bypass_after", "accumulated into gradients being averaged", "an_op_a_layer_launched_early_not_all_fused"),
    ("bypass_alone", "without a synchronised backward pass", "one_fused_op_at_the_end"),
    ("clipped_in_flight", "change them after optimizer.synchronize()", "one_fused_op_at_the_end"),
    ("clipped_in_flight", "change them after optimizer.synchronize()", "an_op_a_layer_launched_early_not_all_fused")])
def test_a_pass_that_bypasses_the_outputs_is_refused_and_the_hooks_come_back(kind, refusal, plan):
    """After a synchronised pass, a second one on the parameters alone would add to gradients in
    flight; alone, it would never be averaged: each is refused, before the optimizer steps, and from
    then on the hooks begin every iteration (a pass on the parameters alone is then averaged).
    Gradients clipped in place while in flight are refused alike, the message naming the remedy."""
    record = run_steps(["plain"] * WARM + [kind, "bypass_alone", "plain"], plan=plan)
    at_outputs, error, _ = record[WARM]
    assert at_outputs and refusal in error
    assert not any(at for at, _, _ in record[WARM + 1:])
    assert all(error is None for _, error, _ in record[WARM + 1:])
    assert all(difference < 1e-6 for _, _, difference in record)


def test_a_pass_that_bypasses_the_outputs_once_the_gradients_are_read_adds_to_their_averages():
    """Read before the step (``synchronize``, which brings the hooks back), the gradients are
    averaged: a second pass on the parameters alone adds to them, its own iteration averaging what
    it adds, as under torch DDP."""
    record = run_steps(["plain"] * WARM + ["bypass_after_synchronize", "plain"])
    assert record[WARM][0]
    assert not any(at for at, _, _ in record[WARM + 1:])
    assert all(error is None and difference < 1e-6 for _, error, difference in record)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", PLANS)
def test_iterations_begin_at_the_outputs_on_cuda_over_nccl(plan):
    """On the GPU the output's hook runs on the device's autograd thread and NCCL writes the op
    buffers without moving their version counters: the outputs begin, and a pass that bypasses
    them after a synchronised one is still refused."""
    result, = run_local(steps_beside_averaged_by_hand, 1, ["plain"] * WARM + ["bypass_after", "plain"], False,
                        "cuda", *PLANS[plan], backend="nccl", timeout=300)
    check_plan_shape(result, plan)
    record = result["steps"]
    assert record[WARM][0] and "accumulated into gradients being averaged" in record[WARM][1]
    assert not record[WARM + 1][0]
    assert all(difference < 1e-6 for _, _, difference in record)


def generator_and_discriminator(rank, world_size, front: str, generator_first: bool = False):
    """A GAN's alternating steps, the discriminator frozen (requires_grad off) for the generator's:
    under gradsync (two runtimes, DDP's buckets, whose iterations may begin at the outputs; or, for
    the discriminator, ByteScheduler's blocks, which launch as the gradients are ready), or under
    torch DDP; `generator_first`: each round begins with the generator's step, so the
    discriminator's first forward runs frozen. Both models' parameters after 8 rounds (the
    discriminator's iterations begin at its outputs from the fifth under DDP's buckets), and
    whether the discriminator's may begin at its outputs then."""
    torch.manual_seed(0)
    generator, discriminator = (nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)),
                                nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)))
    g_optimizer = torch.optim.SGD(generator.parameters(), lr=0.05)
    d_optimizer = torch.optim.SGD(discriminator.parameters(), lr=0.05)
    if front != "ddp":
        g, g_optimizer = gradsync.wrap(generator, g_optimizer, scheduler="ddp", cost=COST)
        blocks = {"profile": ParameterTable.of(discriminator).profile("d", None, {"0": 1e-3, "2": 1e-3},
                                                                       {"0": 2e-3, "2": 2e-3}),
                  "partition_bytes": 64} if front == "bytescheduler" else {}
        d, d_optimizer = gradsync.wrap(discriminator, d_optimizer, scheduler=front.replace("gradsync", "ddp"),
                                       cost=COST, **blocks)
    else:
        g, d = nn.parallel.DistributedDataParallel(generator), nn.parallel.DistributedDataParallel(discriminator)
    numbers = torch.Generator().manual_seed(rank)

    def discriminator_step(fake):
        d_optimizer.zero_grad()
        (F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()).backward()
        d_optimizer.step()

    def generator_step(fake):
        g_optimizer.zero_grad()
        discriminator.requires_grad_(False)
        F.softplus(-d(fake)).mean().backward()
        g_optimizer.step()
        discriminator.requires_grad_(True)

    for _ in range(8):
        real, noise = torch.randn(6, 8, generator=numbers), torch.randn(6, 4, generator=numbers)
        fake = g(noise)
        for step in (generator_step, discriminator_step) if generator_first else (discriminator_step, generator_step):
            step(fake)
    outputs_begin = None
    if front != "ddp":
        outputs_begin = attached(discriminator).outputs_may_begin
        for model in (generator, discriminator):
            attached(model).detach()
    return [p.detach().clone() for p in (*generator.parameters(), *discriminator.parameters())], outputs_begin


def test_a_model_frozen_for_another_models_step_trains_as_under_torch_ddp():
    """The discriminator's runtime, its plans installed while its parameters were frozen, lets its
    iterations begin at the outputs once they train again; a pass in which none of its parameters
    trains is no iteration of it, and takes no hook on a frozen parameter: neither an arrival hook
    nor, where its first forward runs frozen under ByteScheduler's plan, a ready hook."""
    ours, theirs = (run_local(generator_and_discriminator, 2, front) for front in ("gradsync", "ddp"))
    for (mine, outputs_begin), (reference, _) in zip(ours, theirs):
        assert max((p - q).abs().max().item() for p, q in zip(mine, reference)) < 1e-6
        assert outputs_begin
    ours, theirs = (run_local(generator_and_discriminator, 2, front, True) for front in ("bytescheduler", "ddp"))
    for (mine, _), (reference, _) in zip(ours, theirs):
        assert max((p - q).abs().max().item() for p, q in zip(mine, reference)) < 1e-6


@dataclasses.dataclass
class Prediction:
    """A forward's outputs as a dataclass, as some libraries return them."""

    logits: torch.Tensor
    extra: tuple


class ReturnsDataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, inputs):
        hidden = torch.tanh(self.first(inputs))
        return Prediction(self.last(hidden), ({"hidden": hidden},))


def penalised_loss(network: nn.Module, case: str, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy plus, for "input_penalty", the squared gradient of the outputs with respect
    to the inputs (WGAN-GP's, R1's), or, for "gradient_penalty", the squared gradients of the loss
    with respect to the parameters; each taken with ``torch.autograd.grad``, a pass that accumulates
    no gradient, before the backward pass."""
    if case == "input_penalty":
        inputs = inputs.clone().requires_grad_(True)
        outputs = network(inputs)
        slope, = torch.autograd.grad(outputs.sum(), inputs, create_graph=True)
        return F.cross_entropy(outputs, targets) + 0.1 * slope.square().sum()
    loss = F.cross_entropy(network(inputs), targets)
    gradients = torch.autograd.grad(loss, list(network.parameters()), create_graph=True)
    return loss + 0.1 * sum(gradient.square().sum() for gradient in gradients)


def beside_ddp_with_the_outputs_start(rank, world_size, case: str):
    """8 steps of `case` beside torch DDP: "dataclass", a model whose forward returns a dataclass;
    "inference", each step followed by an evaluation under torch.inference_mode (where even
    enable_grad records no graph); "input_penalty" and "gradient_penalty", losses with a penalty
    taken by ``torch.autograd.grad`` (`penalised_loss`). The distance to DDP's parameters, and
    whether the iterations began at the outputs by then."""
    torch.manual_seed(0)
    model = ReturnsDataclass() if case == "dataclass" else nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    logits = (lambda outputs: outputs.logits) if case == "dataclass" else (lambda outputs: outputs)
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model, optimizer = gradsync.wrap(model, torch.optim.Adam(model.parameters(), lr=0.01), scheduler="ddp", cost=COST)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(8):
        inputs, targets = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
        for network, stepper in ((model, optimizer), (reference, reference_optimizer)):
            stepper.zero_grad()
            if case.endswith("penalty"):
                penalised_loss(network, case, inputs, targets).backward()
            else:
                F.cross_entropy(logits(network(inputs)), targets).backward()
            stepper.step()
            if case == "inference":
                with torch.inference_mode():
                    network(inputs)
    began = attached(model).begins_at_outputs
    attached(model).detach()
    return distance(model, reference.module), began


@pytest.mark.parametrize("case", ["dataclass", "inference"])
def test_a_dataclass_output_or_an_inference_mode_evaluation_lets_the_outputs_begin(case):
    """A dataclass's tensors are found; an inference-mode forward leaves the start to the next one."""
    for apart, began in run_local(beside_ddp_with_the_outputs_start, 2, case):
        assert apart < 1e-6
        assert began


@pytest.mark.parametrize("case", ["input_penalty", "gradient_penalty"])
def test_a_pass_of_torch_autograd_grad_before_the_backward_pass_is_no_iteration(case):
    """A penalty's ``torch.autograd.grad`` pass reaches the outputs' hooks (the inputs' penalty)
    or the parameters' (their gradients' penalty), and accumulates nothing: no iteration begins
    there, under the parameters' hooks and at the outputs alike, and the backward pass after it
    trains as under torch DDP. Over the inputs the graph names no parameter: the parameters' hooks
    begin the iterations from then on."""
    for apart, began in run_local(beside_ddp_with_the_outputs_start, 2, case):
        assert apart < 1e-6
        assert began == (case == "gradient_penalty")

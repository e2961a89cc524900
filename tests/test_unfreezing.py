"""Parameters frozen at wrap and unfrozen later (a backbone fine-tuned after its head, as Lightning's
BackboneFinetuning does) join the plans at the next forward pass, every rank at the same one: trained
beside torch DDP made again after the unfreezing (torch DDP made once would leave them out without a
word); a compressor keeps the earlier tensors' state; unfreezing that cannot be taken in is refused
before any update."""
import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync import ConfigError, compress
from gradsync.errors import PeersTimedOut
from gradsync.launch import run_local
from gradsync.profile import TensorSpec
from gradsync.runtime import attach, attached, check_wrap_arguments
from launches import side_by_side
from runtime_models import (BACKBONE_WIDTH, COST, Backbone, backbone_loss, backbone_optimizer, refusal_and_change,
                            unfreeze_backbone)

FROZEN_STEPS, TRAINED_STEPS = 2, 8  # the plans come after the calibration's 4 iterations, then 4 more steps


def ranks_apart(model: nn.Module) -> float:
    """The largest difference of a parameter between rank 0's model and rank 1's."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    torch.distributed.all_gather(gathered, flat)
    return (gathered[0] - gathered[1]).abs().max().item()


def wrapped_and_trained_frozen(rank: int, everything: bool = True, **options):
    """A seeded Backbone wrapped with its backbone frozen (`scheduler="ddp"` unless `options` say
    otherwise), trained `FROZEN_STEPS`; the model, the torch optimizer and gradsync's."""
    torch.manual_seed(0)
    model = Backbone()
    model.backbone.requires_grad_(False)
    optimizer = backbone_optimizer(model, everything)
    model, synced = gradsync.wrap(model, optimizer, **{"scheduler": "ddp", "cost": COST, **options})
    train(model, synced, rank, range(FROZEN_STEPS))
    return model, optimizer, synced


def train(model, optimizer, rank: int, steps: range, device: str = "cpu") -> None:
    for step in steps:
        optimizer.zero_grad()
        backbone_loss(model, rank, step, device).backward()
        optimizer.step()


def frozen_then_trained(rank, world_size, scheduler, options, everything, device="cpu"):
    """The backbone frozen at wrap for `FROZEN_STEPS`, then unfrozen (before a forward pass) for
    `TRAINED_STEPS`, under gradsync and under torch DDP made again at the unfreezing, on `device`.
    Returns the largest difference of their parameters, how far the backbone moved, the plans'
    tensors and whether the plan of a measured profile came."""
    torch.manual_seed(0)
    reference = Backbone().to(device)
    reference.backbone.requires_grad_(False)
    model = Backbone().to(device)
    model.load_state_dict(reference.state_dict())
    model.backbone.requires_grad_(False)
    start = model.backbone[0].weight.detach().clone()
    model, optimizer = gradsync.wrap(model, backbone_optimizer(model, everything), scheduler=scheduler, cost=COST,
                                     **options)
    reference_optimizer = backbone_optimizer(reference, everything)
    train(model, optimizer, rank, range(FROZEN_STEPS), device)
    train(DistributedDataParallel(reference), reference_optimizer, rank, range(FROZEN_STEPS), device)
    unfreeze_backbone(model, optimizer, everything)
    unfreeze_backbone(reference, reference_optimizer, everything)
    trained_steps = range(FROZEN_STEPS, FROZEN_STEPS + TRAINED_STEPS)
    train(model, optimizer, rank, trained_steps, device)
    train(DistributedDataParallel(reference), reference_optimizer, rank, trained_steps, device)
    sync = attached(model)
    sync.flush()
    apart = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    moved = (model.backbone[0].weight - start).abs().max().item()
    planned = sorted({name for op in sync.plan.ops for name in op.tensors()})
    measured = sync.measurement is None
    sync.detach()
    return apart, moved, planned, measured


SCHEDULERS = [("ddp", {}), ("wfbp", {}), ("us_byte", {"partition_bytes": 256}), ("auto", {"plan_trials": 1})]


@pytest.mark.parametrize("everything", [True, False], ids=["optimizer_over_all", "param_group_added"])
def test_a_backbone_unfrozen_after_the_wrap_trains_as_under_torch_ddp_made_again(everything):
    variants = [(scheduler, options, everything) for scheduler, options in SCHEDULERS]
    for (scheduler, _, _), results in zip(variants, side_by_side(frozen_then_trained, *variants)):
        for apart, moved, planned, measured in results:
            assert apart < 1e-6, scheduler
            assert moved > 1e-3, scheduler
            assert "backbone.0.weight" in planned and "head.weight" in planned, scheduler
            assert measured, scheduler


@pytest.mark.gpu
def test_a_backbone_unfrozen_after_the_wrap_trains_as_under_torch_ddp_on_cuda_over_nccl():
    """One rank on the GPU: the new plans' buffers and the codec's state on CUDA, NCCL's ops."""
    for scheduler, options in SCHEDULERS[:3]:
        (apart, moved, planned, measured), = run_local(frozen_then_trained, 1, scheduler, options, False, "cuda",
                                                      backend="nccl", timeout=300)
        assert apart < 1e-6 and moved > 1e-3 and "backbone.0.weight" in planned and measured, scheduler


def evaluated_while_the_head_is_frozen_for_now(rank, world_size):
    """Under ACP-SGD, the backbone unfrozen while the head is frozen for one step (as a GAN freezes its
    discriminator for the generator's), then evaluated (under inference mode, then no_grad) before it
    trains. An evaluation's forward leaves the take-in to the next training forward (the new plans'
    buffers would be inference tensors); the head stays in the new table, and training it again takes
    nothing in. Returns whether an evaluation took the backbone in, whether training did, whether the
    head stayed, whether another take-in followed, and how far the ranks are apart."""
    model, _, optimizer = wrapped_and_trained_frozen(rank, compressor="acp_sgd")
    sync = attached(model)
    first = sync.installed
    model.head.requires_grad_(False)
    unfreeze_backbone(model, optimizer, True)
    with torch.inference_mode():
        model(torch.zeros(1, BACKBONE_WIDTH))
    with torch.no_grad():
        model(torch.zeros(1, BACKBONE_WIDTH))
    taken_at_evaluation = sync.installed is not first
    train(model, optimizer, rank, range(FROZEN_STEPS, FROZEN_STEPS + 1))
    taken = sync.installed
    head_kept = "head.weight" in sync.table.parameters
    model.head.requires_grad_(True)
    train(model, optimizer, rank, range(FROZEN_STEPS + 1, FROZEN_STEPS + 6))
    apart = ranks_apart(model)
    sync.detach()
    return taken_at_evaluation, taken is not first, head_kept, sync.installed is not taken, apart


def test_a_training_forward_takes_the_unfrozen_in_keeping_those_frozen_for_now():
    for at_evaluation, taken, head_kept, taken_again, apart in run_local(evaluated_while_the_head_is_frozen_for_now, 2):
        assert not at_evaluation and taken
        assert head_kept and not taken_again
        assert apart == 0.0


def unfrozen_between_forward_and_step(rank, world_size):
    """The backbone unfrozen after a forward pass, before its backward: that step is refused and
    changes nothing; after optimizer.zero_grad() the next forward takes it in, and it trains alike
    on both ranks. Returns the refusal, whether the refused step changed a parameter, the ranks'
    parameters after two more steps and how far the backbone moved."""
    model, _, optimizer = wrapped_and_trained_frozen(rank)
    optimizer.zero_grad()
    loss = backbone_loss(model, rank, FROZEN_STEPS)
    model.backbone.requires_grad_(True)  # the forward has run: its graph holds no backbone gradient
    loss = loss + sum(p.sum() for p in model.backbone.parameters()) * 1e-3  # but this term has one
    loss.backward()
    refusal, changed = refusal_and_change(optimizer.step, model)
    refusal = str(refusal)
    start = model.backbone[0].weight.detach().clone()
    train(model, optimizer, rank, range(FROZEN_STEPS + 1, FROZEN_STEPS + 3))
    moved = (model.backbone[0].weight - start).abs().max().item()
    apart = ranks_apart(model)
    attached(model).detach()
    return refusal, changed, apart, moved


def test_a_backbone_unfrozen_between_the_forward_and_the_step_is_refused_then_joins_at_the_next_forward():
    for refusal, changed, apart, moved in run_local(unfrozen_between_forward_and_step, 2):
        assert "were unfrozen after this iteration's forward pass began" in refusal
        assert "['backbone.0.weight', 'backbone.0.bias'," in refusal
        assert not changed
        assert apart == 0.0 and moved > 1e-3


def unfrozen_apart(rank, world_size, which):
    """Ranks that unfreeze differently: `which` "different" (rank 1 another layer), or "first" (rank 0
    alone). Returns this rank's error type and message."""
    model, _, optimizer = wrapped_and_trained_frozen(rank, timeout=3)
    if which == "different":
        model.backbone[2 * rank].requires_grad_(True)
    elif rank == 0:
        model.backbone.requires_grad_(True)
    refusal, _ = refusal_and_change(lambda: train(model, optimizer, rank, range(FROZEN_STEPS, FROZEN_STEPS + 1)),
                                    model)
    attached(model)._release()
    return type(refusal).__name__, str(refusal)


def test_ranks_that_unfreeze_different_parameters_are_refused_on_every_rank_before_the_plans_change():
    for error, message in run_local(unfrozen_apart, 2, "different"):
        assert error == ConfigError.__name__
        assert "ranks [1] have a different set of parameters unfrozen since the last plans were made" in message
        assert "unfreeze the same parameters on every rank, before the same forward pass" in message


def test_a_rank_that_unfreezes_alone_ends_in_peers_timed_out_naming_the_check():
    """Its peer never enters the check: it times out there (3 s), and the peer's op, waiting for it,
    fails too."""
    (first_error, first_message), (second_error, _) = run_local(unfrozen_apart, 2, "first", timeout=60)
    assert first_error == PeersTimedOut.__name__
    assert "the check that every rank unfroze the same parameters" in first_message
    assert second_error != type(None).__name__


def head_state(codec) -> dict:
    """The codec's state of the head's tensors, each flat: shared factors and this rank's error
    feedback (a pair of factors concatenated)."""
    shared, per_rank = codec.state_dict()
    return {(part, key, name): torch.cat([t.reshape(-1) for t in (value if isinstance(value, tuple) else (value,))])
            for part, state in (("shared", shared), ("rank", per_rank))
            for key, entries in state.items() if isinstance(entries, dict)
            for name, value in entries.items() if name.startswith("head.")}


def unfrozen_under_a_compressor(rank, world_size, compressor):
    """The backbone unfrozen under `compressor`: the codec keeps the head's state as the backbone
    joins; after 4 steps the state is saved, and a run resumed from it (a new wrap, the backbone
    frozen, then unfrozen before the load) ends where the straight one does 3 steps later. Returns
    whether the head's state was kept, whether the backbone's state was saved, how far the ranks
    are apart, how far the backbone moved and the resumed run's difference to the straight one."""
    model, _, synced = wrapped_and_trained_frozen(rank, compressor=compressor)
    codec = attached(model).codec
    before = head_state(codec)
    unfreeze_backbone(model, synced, True)
    model(torch.zeros(1, BACKBONE_WIDTH))  # the forward pass that takes the backbone in (a training one)
    after = head_state(codec)
    kept = bool(before) and before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    start = model.backbone[0].weight.detach().clone()
    train(model, synced, rank, range(FROZEN_STEPS, FROZEN_STEPS + 4))
    saved_model, saved_state = copy.deepcopy(model.state_dict()), copy.deepcopy(synced.state_dict())
    state = saved_state["gradsync"]
    backbone_saved = any(name.startswith("backbone.") for part in (state["shared"], *state["per_rank"])
                         for entries in part.values() if isinstance(entries, dict) for name in entries)
    resumed_steps = range(FROZEN_STEPS + 4, FROZEN_STEPS + 7)
    train(model, synced, rank, resumed_steps)
    straight = [p.detach().clone() for p in model.parameters()]
    moved = (model.backbone[0].weight - start).abs().max().item()
    apart = ranks_apart(model)
    attached(model).detach()

    resumed = Backbone()
    resumed.load_state_dict(saved_model)
    resumed.backbone.requires_grad_(False)
    optimizer = backbone_optimizer(resumed, True)
    resumed, synced = gradsync.wrap(resumed, optimizer, scheduler="ddp", cost=COST, compressor=compressor)
    unfreeze_backbone(resumed, synced, True)
    synced.load_state_dict(saved_state)
    train(resumed, synced, rank, resumed_steps)
    resumed_apart = max((a - b).abs().max().item() for a, b in zip(resumed.parameters(), straight))
    attached(resumed).detach()
    return kept, backbone_saved, apart, moved, resumed_apart


def test_a_backbone_unfrozen_under_a_compressor_joins_its_state_and_resumes_exactly():
    compressors = ("acp_sgd", "powersgd", "topk")
    for compressor, results in zip(compressors, side_by_side(unfrozen_under_a_compressor,
                                                             *[(name,) for name in compressors])):
        for kept, backbone_saved, apart, moved, resumed_apart in results:
            assert kept and backbone_saved, compressor
            assert apart == 0.0 and moved > 1e-3, compressor
            assert resumed_apart == 0.0, compressor


@pytest.mark.parametrize("name", compress.names())
def test_every_codec_takes_in_new_tensors_keeping_the_state_of_the_earlier_ones(name):
    """No ranks: each registered codec set up for the head, then taking in the backbone; its shared
    state (a low-rank codec's initial factors) of the head is kept, the backbone's equals what a
    codec set up for both from the same seed starts with."""
    specs = {tensor: TensorSpec(tensor, BACKBONE_WIDTH * BACKBONE_WIDTH, 4, (BACKBONE_WIDTH, BACKBONE_WIDTH))
             for tensor in ("backbone.weight", "head.weight")}
    codec = compress.get(name)
    codec.setup({"head.weight": specs["head.weight"]}, 2, seed=7)
    before, _ = codec.state_dict()
    codec.take_in(specs)
    after, _ = codec.state_dict()
    both = compress.get(name)
    both.setup(specs, 2, seed=7)
    fresh, _ = both.state_dict()
    assert codec.specs == specs
    assert after.keys() == fresh.keys()
    for key, entries in after.items():
        if isinstance(entries, dict) and entries and isinstance(next(iter(entries.values())), torch.Tensor):
            assert entries.keys() == fresh[key].keys()
            assert torch.equal(entries["head.weight"], before[key]["head.weight"]), key
            assert torch.equal(entries["backbone.weight"], fresh[key]["backbone.weight"]), key


def unfrozen_where_the_optimizer_is_fixed(rank, world_size):
    """A runtime attached with ``takes_unfrozen=False`` (as for DeepSpeed's ZeRO and mixed-precision
    optimizers, whose parameters are fixed at the attach), its optimizer holding the frozen backbone:
    the backbone unfrozen is refused at the step, changing nothing. Returns the refusal and whether
    a parameter changed."""
    torch.manual_seed(0)
    model = Backbone()
    model.backbone.requires_grad_(False)
    model, optimizer = attach(model, backbone_optimizer(model, True), check_wrap_arguments("ddp", cost=COST),
                              takes_unfrozen=False)
    train(model, optimizer, rank, range(FROZEN_STEPS))
    unfreeze_backbone(model, optimizer, True)
    optimizer.zero_grad()
    backbone_loss(model, rank, FROZEN_STEPS).backward()
    refusal, changed = refusal_and_change(optimizer.step, model)
    attached(model).detach()
    return str(refusal), changed


def test_a_runtime_that_takes_nothing_in_refuses_an_unfrozen_parameter_at_the_step():
    for refusal, changed in run_local(unfrozen_where_the_optimizer_is_fixed, 2):
        assert "['backbone.0.weight', 'backbone.0.bias', " in refusal
        assert "were frozen when gradsync attached and train now" in refusal
        assert not changed


def unfrozen_between_two_backward_passes(rank, world_size):
    """Two backward passes before one step (the second adds to the first's averages, as under DDP),
    the backbone unfrozen between them: refused at the second forward; the step then applies the
    first pass's averages, and the backbone joins at the next forward. Returns the refusal and the
    ranks' parameters apart after two more steps."""
    model, _, optimizer = wrapped_and_trained_frozen(rank)
    optimizer.zero_grad()
    backbone_loss(model, rank, FROZEN_STEPS).backward()
    model.backbone.requires_grad_(True)
    refusal, _ = refusal_and_change(lambda: backbone_loss(model, rank, FROZEN_STEPS + 1), model)
    optimizer.step()
    train(model, optimizer, rank, range(FROZEN_STEPS + 2, FROZEN_STEPS + 4))
    apart = ranks_apart(model)
    attached(model).detach()
    return str(refusal), apart


def test_a_backbone_unfrozen_between_two_backward_passes_of_a_step_is_refused_at_the_forward():
    for refusal, apart in run_local(unfrozen_between_two_backward_passes, 2):
        assert "were unfrozen between a synchronised backward pass and its optimizer.step()" in refusal
        assert apart == 0.0

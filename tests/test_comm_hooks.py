"""gradsync.comm_hooks: every compressor as a torch DDP communication hook, against gradsync.wrap
on the same model and data (the same runtime op per bucket, so the same numbers), torch DDP's own
all-reduce, and itself resumed from a checkpoint; 2 gloo ranks."""
import copy
import pickle
import random

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
from gradsync.comm_hooks import CompressionState, compression_hook
from gradsync.errors import ConfigError
from gradsync.launch import run_local
from gradsync.runtime import attached
from launches import side_by_side
from runtime_models import COST, synthetic_profile

STEPS = 6
ONE_PARAMETER_PER_BUCKET = 1e-6  # bucket_cap_mb: DDP puts each parameter in its own bucket


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10),
                               torch.nn.Tanh(), torch.nn.Linear(10, 3))


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 12, generator=generator), torch.randn(8, 3, generator=generator)


def train_step(module, optimizer, rank: int, step: int, scale: float = 1.0) -> None:
    inputs, targets = batch(rank, step)
    optimizer.zero_grad()
    (torch.nn.functional.mse_loss(module(inputs), targets) * scale).backward()
    optimizer.step()


def hooked(compressor, bucket_cap_mb: float = 25, **state_options):
    """A freshly seeded model under DDP with a CompressionState's hook: (DDP model, optimizer, state)."""
    module = model()
    state = CompressionState(module, compressor, **state_options)
    ddp = DDP(module, bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(state, compression_hook)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), state


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def matches_wrap(compressor: dict, align_factors: bool) -> float:
    """Largest parameter difference between the hook (one parameter per bucket past DDP's first)
    and wrap's wfbp (one op per parameter on any cost model: a given one spares the network
    probes) after STEPS steps. With `align_factors`, wrap's low-rank codec starts from the hook's
    first queries (each run's rank 0 draws its own seed), read after the hook's step 0 (a P step,
    whose query Orth(Q₀) the codec keeps as its next Q)."""
    rank = dist.get_rank()
    ddp, optimizer, state = hooked(compressor, ONE_PARAMETER_PER_BUCKET)
    for step in range(STEPS):
        train_step(ddp, optimizer, rank, step)
        if step == 0:
            queries = {name: query.clone() for name, query in getattr(state.codec, "q_prev", {}).items()}
    wrapped = model()
    wrapped, wrapped_optimizer = gradsync.wrap(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1),
                                               scheduler="wfbp", compressor=compressor, cost=COST)
    codec = attached(wrapped).installed.codec
    if align_factors:
        assert queries.keys() == codec.q_prev.keys() and len(queries) == 2  # the matrices worth compressing
        codec.q_prev.update(queries)
    for step in range(STEPS):
        train_step(wrapped, wrapped_optimizer, rank, step)
    return (flat(ddp.module) - flat(wrapped)).abs().max().item()


def accumulated_beside_wrap(compressor) -> float:
    """Largest parameter difference between the hook and wrap's wfbp after STEPS backward passes,
    every other one accumulated locally (DDP's no_sync against gradsync.no_sync)."""
    rank = dist.get_rank()
    ddp, optimizer, _ = hooked(compressor)
    wrapped = model()
    wrapped, wrapped_optimizer = gradsync.wrap(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1),
                                               scheduler="wfbp", compressor=compressor, cost=COST)
    for network, stepper, no_sync in ((ddp, optimizer, ddp.no_sync), (wrapped, wrapped_optimizer,
                                                                      lambda: gradsync.no_sync(wrapped))):
        for step in range(STEPS):
            inputs, targets = batch(rank, step)
            if step % 2 == 0:
                with no_sync():
                    torch.nn.functional.mse_loss(network(inputs), targets).backward()
                continue
            torch.nn.functional.mse_loss(network(inputs), targets).backward()
            stepper.step()
            stepper.zero_grad()
    return (flat(ddp.module) - flat(wrapped)).abs().max().item()


def beside_wrap(rank, world_size):
    ddp, optimizer, _ = hooked(None)  # DDP's own buckets, several parameters each
    reference = DDP(model())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        train_step(ddp, optimizer, rank, step)
        train_step(reference, reference_optimizer, rank, step)
    gathered = [torch.empty_like(flat(ddp.module)) for _ in range(world_size)]
    dist.all_gather(gathered, flat(ddp.module))
    return {"identity_vs_ddp": (flat(ddp.module) - flat(reference.module)).abs().max().item(),
            "acp_sgd": matches_wrap({"type": "acp_sgd", "rank": 2}, align_factors=True),
            "signsgd": matches_wrap({"type": "signsgd"}, align_factors=False),
            "signsgd_accumulated": accumulated_beside_wrap({"type": "signsgd"}),
            "ranks_differ": (gathered[0] - gathered[1]).abs().max().item()}


def test_hooks_compute_what_wrap_computes_and_the_identity_what_ddp_does():
    """Also with gradients accumulated under no_sync every other backward pass."""
    for result in run_local(beside_wrap, 2):
        assert result["identity_vs_ddp"] <= 1e-6
        assert result["acp_sgd"] <= 1e-6
        assert result["signsgd"] <= 1e-6 and result["signsgd_accumulated"] <= 1e-6
        assert result["ranks_differ"] == 0.0


def resumed(rank, world_size, compressor):
    """Parameters after STEPS steps uninterrupted; after a checkpoint (the state's state_dict, the
    model's and the optimizer's) at STEPS // 2 restored into a fresh DDP model and state; after a
    pickled copy of the model and its state at STEPS // 2 (as a spawn launcher sends them); and
    whether an overflowing step (loss × inf, a GradScaler's skipped step) left the state as it was."""
    ddp, optimizer, state = hooked(compressor)
    for step in range(STEPS // 2):
        train_step(ddp, optimizer, rank, step)
    checkpoint = copy.deepcopy((state.state_dict(), ddp.module.state_dict(), optimizer.state_dict()))
    module, pickled_state = pickle.loads(pickle.dumps((ddp.module, state)))
    for step in range(STEPS // 2, STEPS):
        train_step(ddp, optimizer, rank, step)
    again, again_optimizer, again_state = hooked(compressor)
    again_state.load_state_dict(checkpoint[0])
    again.module.load_state_dict(checkpoint[1])
    again_optimizer.load_state_dict(checkpoint[2])
    spawned = DDP(module)
    spawned.register_comm_hook(pickled_state, compression_hook)
    spawned_optimizer = torch.optim.SGD(spawned.parameters(), lr=0.1)
    spawned_optimizer.load_state_dict(checkpoint[2])
    for step in range(STEPS // 2, STEPS):
        train_step(again, again_optimizer, rank, step)
        train_step(spawned, spawned_optimizer, rank, step)
    before = copy.deepcopy(state.state_dict())
    inputs, targets = batch(rank, 99)
    optimizer.zero_grad()
    (torch.nn.functional.mse_loss(ddp(inputs), targets) * float("inf")).backward()
    overflowed = all(not torch.isfinite(p.grad).all() for p in ddp.module.parameters() if p.dim() == 2)
    return {"resumed_equal": torch.equal(flat(ddp.module), flat(again.module)),
            "pickled_equal": torch.equal(flat(ddp.module), flat(spawned.module)), "overflowed": overflowed,
            "state_kept": _tensors(before) and all(torch.equal(x, y) for x, y in zip(_tensors(before),
                                                                                       _tensors(state.state_dict())))}


def _tensors(state: dict) -> list[torch.Tensor]:
    """Every tensor of a CompressionState's saved codec state, in a fixed order."""
    found = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(state["codec"])
    return found


@pytest.mark.parametrize("compressor", [{"type": "acp_sgd", "rank": 2}, {"type": "powersgd", "rank": 2},
                                        {"type": "topk", "density": 0.1}])
def test_a_resumed_hook_continues_bit_identically_and_an_overflow_leaves_its_state(compressor):
    for result in run_local(resumed, 2, compressor):
        assert result["resumed_equal"] and result["pickled_equal"]
        assert result["overflowed"] and result["state_kept"]


def scaled_replica(module, compressor, front: str, scaler):
    """`module` averaged through `compressor` by `front`: "hook" (torch DDP with gradsync's hook,
    one parameter per bucket) or "wrap" (gradsync.wrap, one op per parameter), each following
    `scaler`, the GradScaler. Both runs of a comparison start from the same low-rank factors.
    Returns (model, optimizer)."""
    if front == "hook":
        ddp = DDP(module, bucket_cap_mb=ONE_PARAMETER_PER_BUCKET)
        state = CompressionState(module, compressor, seed=7)
        state.follow_loss_scale(scaler.get_scale)
        ddp.register_comm_hook(state, compression_hook)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)
    random.seed(7)  # rank 0 draws the codec's seed
    return gradsync.wrap(module, torch.optim.SGD(module.parameters(), lr=0.1), scheduler="wfbp",
                         compressor=compressor, grad_scaler=scaler, profile=synthetic_profile(module), cost=COST)


def under_grad_scaler(rank, world_size, compressor, overflow_at, device="cpu", front="hook", overflow="scale"):
    """Parameters after STEPS steps of fp16 autocast with torch's GradScaler on `device`, where step
    `overflow_at` (None: none) first runs with an overflow: the scaler must skip it and back off;
    then the step runs again at the scale of every other, 2^8. `overflow`: "scale", a loss scale
    that overflows float16 (2^40) in every gradient; "first_layer", an inf in rank 0's gradient of
    the first layer's weight alone, the last to be averaged (after the other layers' are decoded)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    module = model().to(device)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**8)
    replica, optimizer = scaled_replica(module, compressor, front, scaler)
    backed_off = None
    for step in range(STEPS):
        for overflowing in ([True, False] if step == overflow_at else [False]):
            if overflowing and overflow == "scale":
                scaler.update(new_scale=2.0**40)
            poison = module[0].weight.register_hook(lambda g: g * float("inf")) \
                if overflowing and overflow == "first_layer" and rank == 0 else None
            inputs, targets = (t.to(device) for t in batch(rank, step))
            optimizer.zero_grad()
            with torch.autocast(device, dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(replica(inputs), targets)
            scaler.scale(loss).backward()
            if poison is not None:
                poison.remove()
            scaler.step(optimizer)  # under wrap, the backward pass ended with the gradients averaged
            scaler.update()
            if overflowing:
                backed_off = scaler.get_scale()
                scaler.update(new_scale=2.0**8)
    return {"parameters": flat(module).cpu(), "backed_off": backed_off}


def skipped_beside_plain(compressor, device="cpu", backend="gloo", world_size=2, front="hook",
                         overflow="scale") -> None:
    """A step the GradScaler skips leaves training as without it: the same parameters, bitwise."""
    skipped, plain = side_by_side(under_grad_scaler, (compressor, STEPS // 2, device, front, overflow),
                                  (compressor, None, device, front), world_size=world_size, backend=backend)
    for with_overflow, without in zip(skipped, plain):
        # the scaler saw the overflow: no update, scale halved
        assert with_overflow["backed_off"] == (2.0**39 if overflow == "scale" else 2.0**7)
        assert torch.equal(with_overflow["parameters"], without["parameters"])
    assert all(torch.equal(skipped[0]["parameters"], other["parameters"]) for other in skipped)
    assert not torch.equal(plain[0]["parameters"], flat(model()))  # it trained


@pytest.mark.parametrize("front", ["hook", "wrap"])
@pytest.mark.parametrize("compressor", [{"type": "acp_sgd", "rank": 2}, {"type": "powersgd", "rank": 2}])
def test_a_step_the_grad_scaler_skips_under_fp16_autocast_leaves_training_as_without_it(compressor, front):
    skipped_beside_plain(compressor, front=front)


@pytest.mark.parametrize("front", ["hook", "wrap"])
@pytest.mark.parametrize("compressor", [{"type": "acp_sgd", "rank": 2}, {"type": "powersgd", "rank": 2},
                                        {"type": "topk", "density": 0.1}])
def test_an_inf_in_the_last_averaged_gradient_alone_leaves_the_earlier_ones_state(compressor, front):
    """The scaler skips a step whose one inf is in the gradient averaged last: the codec's error
    feedback and factors of the tensors decoded before it stay as they were."""
    skipped_beside_plain(compressor, front=front, overflow="first_layer")


@pytest.mark.gpu
def test_a_step_the_grad_scaler_skips_on_cuda_leaves_training_as_without_it():
    skipped_beside_plain({"type": "acp_sgd", "rank": 2}, "cuda", "nccl", 1)


def with_scale_changes(rank, world_size, compressor, front, scaled: bool):
    """Parameters after STEPS fp32 steps with the loss scaled by a GradScaler (`scaled`) whose scale
    starts at 2^10, is set to 2^6 after step 1 (a back-off) and to 2^12 after step 3 (a growth);
    or with the scaler disabled (scale 1)."""
    module = model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
    replica, optimizer = scaled_replica(module, compressor, front, scaler)
    for step in range(STEPS):
        inputs, targets = batch(rank, step)
        optimizer.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(replica(inputs), targets)).backward()
        scaler.step(optimizer)
        scaler.update(new_scale={1: 2.0**6, 3: 2.0**12}.get(step))
    return flat(module)


@pytest.mark.parametrize("front", ["hook", "wrap"])
@pytest.mark.parametrize("compressor", [{"type": "acp_sgd", "rank": 2}, {"type": "powersgd", "rank": 2},
                                        {"type": "signsgd"}])
def test_error_feedback_follows_the_grad_scalers_scale(compressor, front):
    """The error feedback, kept in the scaled gradients' units, is rescaled at each change of the
    scaler's scale: the run trains as the unscaled one (powers of two scale exactly)."""
    scaled, plain = side_by_side(with_scale_changes, (compressor, front, True), (compressor, front, False))
    for with_scale, without in zip(scaled, plain):
        torch.testing.assert_close(with_scale, without, rtol=1e-5, atol=1e-6)
    assert not torch.equal(plain[0], flat(model()))  # it trained


def different_ranks(rank, world_size):
    ddp, optimizer, _ = hooked("acp_sgd", rank=2 + rank)
    train_step(ddp, optimizer, rank, 0)


def test_ranks_with_different_compressor_settings_fail_before_any_gradient_travels():
    results = run_local(different_ranks, 2, return_errors=True, timeout=120)
    for status, text in results:
        assert status == "error" and "different compressor settings" in text


def test_bad_state_arguments_are_refused():
    with pytest.raises(ConfigError, match="'module' must be the torch.nn.Module"):
        CompressionState("acp_sgd")
    with pytest.raises(ConfigError, match="seed"):
        CompressionState(model(), "acp_sgd", seed=-1)
    with pytest.raises(ConfigError, match="options go with a compressor given by name"):
        CompressionState(model(), {"type": "acp_sgd"}, rank=2)
    with pytest.raises(ConfigError, match="unknown compressor"):
        CompressionState(model(), "lossless_magic")


GPU_COMPRESSORS = {"acp_sgd": {"type": "acp_sgd", "rank": 8, "min_compression_rate": 0}, "powersgd": "powersgd",
                   "signsgd": "signsgd", "topk": {"type": "topk", "density": 0.1}, "fp16": "fp16", "bf16": "bf16",
                   "minmax8": "minmax8"}


def hooks_on_cuda(rank, world_size):
    """Per compressor, on cuda:0: the largest difference from torch DDP after STEPS steps (ACP-SGD
    at full rank on square matrices is exact), and whether every rank holds the same parameters."""
    from test_acp_sgd import data, square_net

    torch.cuda.set_device(0)
    results = {}
    for label, compressor in GPU_COMPRESSORS.items():
        torch.manual_seed(0)
        module = square_net().cuda()
        reference = DDP(copy.deepcopy(module))
        state = CompressionState(module, compressor)
        ddp = DDP(module)
        ddp.register_comm_hook(state, compression_hook)
        pairs = [(network, torch.optim.SGD(network.parameters(), lr=0.05)) for network in (ddp, reference)]
        for step in range(STEPS):
            inputs, targets = (t.cuda() for t in data(rank, step))
            for network, optimizer in pairs:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(network(inputs), targets).backward()
                optimizer.step()
        gathered = [torch.empty_like(flat(module)) for _ in range(world_size)]
        dist.all_gather(gathered, flat(module))
        results[label] = ((flat(module) - flat(reference.module)).abs().max().item(),
                          all(torch.equal(gathered[0], other) for other in gathered))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("backend, world_size", [("nccl", 1), ("gloo", 2)])
def test_hooks_run_on_cuda_and_acp_sgd_at_full_rank_equals_ddp(backend, world_size, record_property):
    for rank, results in enumerate(run_local(hooks_on_cuda, world_size, backend=backend)):
        for label, (difference, same_on_ranks) in results.items():
            record_property(f"rank{rank}/{label}", f"{difference:.3g} from DDP")
            assert same_on_ranks, label
        assert results["acp_sgd"][0] < 1e-4

"""ACP-SGD (acp-sgd Algorithm 2): exactness at full rank, error-feedback conservation, identical
factors on every rank, wire sizes, checkpoints, bad input."""
import copy
import math
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync import ConfigError, CostModel, compress
from gradsync.compress.acp_sgd import ACPSGD
from gradsync.compress.orthogonalize import orthogonalize
from gradsync.launch import run_local
from gradsync.profile import TensorSpec
from gradsync.runtime import attached
from gradsync.runtime.parameter_table import ParameterTable
from test_compress_baselines import powersgd_step, specs_of

COST = CostModel(1e-4, 1e-9)


def one_worker_step(codec, name, gradient, step):
    """Encode, 'reduce' on one worker, finish: the gradient the optimizer would see."""
    parameter = nn.Parameter(torch.zeros_like(gradient))
    wire = codec.encode(name, gradient, step)
    codec.reduced_target(name, parameter, step).copy_(wire)
    codec.finish(name, parameter, step)
    codec.settle(applied=True)
    return parameter.grad


def test_error_feedback_conserves_the_gradient_sum():
    codec = ACPSGD(rank=2)
    codec.setup({"w": TensorSpec("w", 30 * 20, 4, (30, 20))}, 1, seed=5)
    generator = torch.Generator().manual_seed(0)
    applied_sum, gradient_sum = torch.zeros(30, 20), torch.zeros(30, 20)
    for step in range(6):
        gradient = torch.randn(30, 20, generator=generator)
        gradient_sum += gradient
        applied_sum += one_worker_step(codec, "w", gradient, step)
        # Σ applied_t + E_t = Σ M_t after every step
        assert torch.allclose(applied_sum + codec.errors["w"], gradient_sum, atol=1e-5)
    assert codec.errors["w"].abs().max() > 1e-3  # rank 2 of a random 30 × 20 matrix is lossy


@pytest.mark.parametrize("shape", [(8, 8), (8, 4, 2)])  # square as matrices: both steps exact
def test_full_rank_is_exact_on_p_and_q_steps(shape):
    n = shape[0]
    m = math.prod(shape[1:])
    codec = ACPSGD(rank=min(n, m), min_compression_rate=0)
    codec.setup({"w": TensorSpec("w", n * m, 4, shape)}, 1, seed=1)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        gradient = torch.randn(shape, generator=generator)
        assert torch.allclose(one_worker_step(codec, "w", gradient, step), gradient, atol=1e-5)


def test_a_given_seed_replaces_the_shared_random_one():
    codec = ACPSGD(rank=2, seed=42)
    codec.setup({"w": TensorSpec("w", 120, 4, (12, 10))}, 1, seed=7)
    other = ACPSGD(rank=2)
    other.setup({"w": TensorSpec("w", 120, 4, (12, 10))}, 1, seed=42)
    assert codec.seed == 42 and torch.equal(codec.q_prev["w"], other.q_prev["w"])


def test_without_reuse_queries_are_fresh_but_equal_for_equal_seeds():
    first, second = ACPSGD(rank=2, reuse=False), ACPSGD(rank=2, reuse=False)
    spec = {"w": TensorSpec("w", 120, 4, (12, 10))}
    first.setup(spec, 1, seed=9)
    second.setup(spec, 1, seed=9)
    gradient = torch.randn(12, 10)
    assert torch.equal(first.encode("w", gradient, 0), second.encode("w", gradient, 0))
    assert not torch.equal(first._query("w", "P", 0, gradient), first._query("w", "P", 2, gradient))


def test_which_tensors_are_compressed_and_their_wire_sizes():
    codec = ACPSGD(rank=4)
    specs = {
        "big": TensorSpec("big", 64 * 32, 4, (64, 32)),  # (64 + 32)·4·2 = 768 < 2048: compressed
        "small": TensorSpec("small", 8 * 8, 4, (8, 8)),  # (8 + 8)·4·2 = 128 ≥ 64: plain
        "bias": TensorSpec("bias", 64, 4, (64,)),
    }
    codec.setup(specs, 2, seed=0)
    assert set(codec.shapes) == {"big"}
    assert codec.wire_spec(specs["big"], "P").numel == 64 * 4
    assert codec.wire_spec(specs["big"], "Q").numel == 32 * 4
    assert codec.wire_spec(specs["small"], "P") == specs["small"]
    assert codec.layouts() == ("P", "Q") and ACPSGD(start_iter=3).layouts() == ("plain", "P", "Q")
    assert [ACPSGD(start_iter=2).layout(s) for s in range(5)] == ["plain", "plain", "P", "Q", "P"]


def test_rank_above_min_dimension_is_clipped_with_one_warning():
    codec = ACPSGD(rank=16, min_compression_rate=0)
    specs = {f"w{i}": TensorSpec(f"w{i}", 8 * 4, 4, (8, 4)) for i in range(3)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        codec.setup(specs, 1, seed=0)
    assert len(caught) == 1 and "3 tensor(s)" in str(caught[0].message)
    assert all(shape == (8, 4, 4) for shape in codec.shapes.values())
    with warnings.catch_warnings(record=True) as caught:  # a small matrix travels whole: nothing clipped
        warnings.simplefilter("always")
        ACPSGD(rank=16).setup({"small": TensorSpec("small", 3 * 100, 4, (3, 100))}, 1, seed=0)
    assert caught == []


@pytest.mark.parametrize("options, field", [({"rank": 0}, "rank"), ({"rank": 2.5}, "rank"),
                                            ({"min_compression_rate": -1}, "min_compression_rate"),
                                            ({"start_iter": -2}, "start_iter"), ({"reuse": "yes"}, "reuse"),
                                            ({"ranks": 4}, "ranks"), ({"seed": -1}, "seed"), ({"seed": 2**63}, "seed"),
                                            ({"seed": True}, "seed")])
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ConfigError, match=field):
        compress.get("acp_sgd", **options)


def test_the_largest_seed_draws_fresh_queries_at_any_step():
    codec = ACPSGD(rank=2, reuse=False, seed=2**63 - 1)
    codec.setup({"w": TensorSpec("w", 12 * 10, 4, (12, 10))}, 1, seed=0)
    for step in (0, 10**9):
        assert codec.encode("w", torch.ones(12, 10), step).shape == (24,)


def test_non_floating_gradients_are_refused_in_setup():
    with pytest.raises(ConfigError, match="floating point"):
        ACPSGD().setup({"w": TensorSpec("w", 12 * 10, 1, (12, 10))}, 1, seed=0)


def test_unknown_compressor_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="acp_sgd"):
        compress.get("zip")


def test_planning_uses_the_compressed_sizes():
    from gradsync import planners
    from gradsync.profile import zoo

    profile = zoo("resnet50")
    codec = ACPSGD(rank=4)
    codec.setup(profile.tensor_map(), 8, seed=0)
    for layout in codec.layouts():
        wire = compress.wire_profile(profile, codec, layout, flops_per_second=1e13)
        plan = planners.get("optimal_merge")(wire, CostModel.preset("asc-wfbp-10gbe")).validate(wire)
        assert sum(op.numel() for op in plan.ops) == wire.num_parameters < profile.num_parameters / 50
        # encode time lands in the backward pass of compressed layers, decode time in the forward
        assert wire.backward_time > profile.backward_time and wire.forward_time > profile.forward_time


# -- on two ranks ------------------------------------------------------------------------------------

def square_net():
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def profile_of(model):
    table = ParameterTable.of(model)
    return table.profile("net", None, {m: 1e-3 for m in table.owners}, {m: 2e-3 for m in table.owners})


def data(rank, step):
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 8, (16,), generator=generator)


def full_rank_matches_ddp(rank, world_size):
    torch.manual_seed(0)
    model = square_net()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="optimal_merge",
                                     compressor={"type": "acp_sgd", "rank": 8, "min_compression_rate": 0},
                                     profile=profile_of(model), cost=COST)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    worst, factors = 0.0, []
    for step in range(4):  # P, Q, P, Q
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        x, y = data(rank, step)
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(reference(x), y).backward()
        optimizer.synchronize()
        worst = max(worst, max((p.grad - q.grad).abs().max().item()
                               for p, q in zip(model.parameters(), reference.parameters())))
        codec = attached(model).codec
        factors.append(torch.cat([t.reshape(-1) for k in sorted(codec.p_prev)
                                  for t in (codec.p_prev[k], codec.q_prev[k])]))
        optimizer.step()
        ref_optimizer.step()
    attached(model).detach()
    return worst, torch.stack(factors).tolist()  # plain values: tensors do not outlive the rank's process


def test_full_rank_equals_uncompressed_averaging_and_factors_agree_across_ranks():
    (worst0, factors0), (worst1, factors1) = run_local(full_rank_matches_ddp, 2)
    assert worst0 < 1e-5 and worst1 < 1e-5
    assert factors0 == factors1  # identical on both ranks after every step


class BranchNet(nn.Module):
    """A trunk, and a branch only rank 0 uses: rank 1 never has the branch's gradients."""

    def __init__(self):
        super().__init__()
        self.trunk = square_net()
        self.branch = nn.Linear(8, 8)

    def forward(self, x, use_branch):
        h = self.trunk(x)
        return h + self.branch(h) if use_branch else h


def branch_used_by_one_rank(rank, world_size, compressor, error_feedback):
    torch.manual_seed(0)
    model = BranchNet()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                     compressor={"type": compressor, "rank": 8, "min_compression_rate": 0,
                                                 "error_feedback": error_feedback},
                                     profile=profile_of(model), cost=COST)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    worst, factors = 0.0, []
    for step in range(4):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        x, y = data(rank, step)
        F.cross_entropy(model(x, rank == 0), y).backward()
        F.cross_entropy(reference(x, rank == 0), y).backward()
        optimizer.synchronize()
        worst = max(worst, max((p.grad - q.grad).abs().max().item()
                               for p, q in zip(model.parameters(), reference.parameters())))
        codec = attached(model).codec
        factors.append(codec.q_prev["branch.weight"].reshape(-1).clone())
        optimizer.step()
        ref_optimizer.step()
    attached(model).detach()
    return worst, torch.stack(factors).tolist()


@pytest.mark.parametrize("compressor", ["acp_sgd", "powersgd"])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_a_tensor_without_gradient_on_one_rank_keeps_the_factors_shared(compressor, error_feedback):
    (worst0, factors0), (worst1, factors1) = run_local(branch_used_by_one_rank, 2, compressor, error_feedback)
    assert worst0 < 1e-5 and worst1 < 1e-5
    assert factors0 == factors1


def wire_bytes(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                     compressor={"type": "acp_sgd", "rank": 4}, profile=profile_of(model),
                                     cost=COST)
    sync = attached(model)
    sizes = {layout: executor.wire_bytes() for layout, executor in sync.installed.executors.items()}
    ops = {layout: len(plan.ops) for layout, plan in sync.installed.plans.items()}
    sync.detach()
    return sizes, ops


def test_bytes_on_the_wire_equal_the_formula():
    sizes, ops = run_local(wire_bytes, 2)[0]
    # "0.weight" (32 × 64) is compressed: P is 32 × 4, Q is 64 × 4; "2.weight" (4 × 32) is not
    # ((4 + 32)·4·2 ≥ 128); biases travel as they are; fp32 flags: one per tensor per op and one
    # per op (wfbp: 4 ops of one tensor each)
    plain = 32 + 4 * 32 + 4
    assert ops == {"P": 4, "Q": 4}
    assert sizes == {"P": 4 * (32 * 4 + plain + 8), "Q": 4 * (64 * 4 + plain + 8)}


def resume(rank, world_size, path):
    def fresh():
        torch.manual_seed(2)
        model = square_net()
        return gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), scheduler="mg_wfbp",
                             compressor={"type": "acp_sgd", "rank": 2, "min_compression_rate": 0},
                             profile=profile_of(model), cost=COST)

    def train(model, optimizer, steps):
        for step in steps:
            optimizer.zero_grad()
            x, y = data(rank, step)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    model, optimizer = fresh()
    train(model, optimizer, range(4))
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}  # every rank calls it
    if rank == 0:
        torch.save(state, path)
    train(model, optimizer, range(4, 7))  # the uninterrupted run goes on
    straight = [p.detach().clone() for p in model.parameters()]
    attached(model).detach()
    torch.distributed.barrier()
    model, optimizer = fresh()  # a restart: new process state, new random seed until the load
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    train(model, optimizer, range(4, 7))
    attached(model).detach()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), straight))


def test_checkpoint_resume_is_bit_identical(tmp_path):
    assert run_local(resume, 2, str(tmp_path / "acp.pt")) == [0.0, 0.0]


def change_of_compressor(rank, world_size):
    """A checkpoint of an uncompressed run resumed with acp_sgd, and with acp_sgd from the same
    checkpoint without gradsync's entry; an acp_sgd checkpoint resumed without compression."""
    def fresh(compressor):
        torch.manual_seed(2)
        random.seed(2)  # rank 0 draws the compressor's seed from it
        model = square_net()
        return gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), scheduler="mg_wfbp",
                             compressor=compressor, profile=profile_of(model), cost=COST)

    def resumed(state, compressor, drop_gradsync=False):
        model, optimizer = fresh(compressor)
        state = copy.deepcopy(state)  # a loaded optimizer would train the state's own momentum tensors
        model.load_state_dict(state["model"])
        optimizer_state = state["optimizer"]
        if drop_gradsync:
            del optimizer_state["gradsync"]
        optimizer.load_state_dict(optimizer_state)
        for step in range(4, 7):
            optimizer.zero_grad()
            x, y = data(rank, step)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        attached(model).detach()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    acp_sgd = {"type": "acp_sgd", "rank": 2, "min_compression_rate": 0}
    saved = {}
    for compressor in (None, acp_sgd):
        model, optimizer = fresh(compressor)
        for step in range(4):
            optimizer.zero_grad()
            x, y = data(rank, step)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        saved[compressor is None] = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        attached(model).detach()
    plain = saved[True]
    difference = (resumed(plain, acp_sgd) - resumed(plain, acp_sgd, drop_gradsync=True)).abs().max().item()
    try:
        resumed(saved[False], None)
        refusal = None
    except ConfigError as error:
        refusal = str(error)
    return difference, refusal


def test_a_checkpoint_without_compression_starts_a_compressor_afresh_and_error_feedback_is_never_dropped():
    for difference, refusal in run_local(change_of_compressor, 2):
        assert difference == 0.0
        assert "holds the state of compressor 'acp_sgd'" in refusal and "delete the 'gradsync' entry" in refusal


def non_finite_skipped(rank, world_size):
    torch.manual_seed(0)
    model = square_net()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                     compressor={"type": "acp_sgd", "rank": 2, "min_compression_rate": 0},
                                     profile=profile_of(model), cost=COST, nonfinite="skip")
    codec = attached(model).codec
    x, y = data(rank, 0)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    before = {k: v.clone() for k, v in codec.errors.items()}
    factors = [t.clone() for k in sorted(codec.p_prev) for t in (codec.p_prev[k], codec.q_prev[k])]
    parameters = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if rank == 1:
        loss = loss + model[0].weight.sum() * float("nan")
    loss.backward()
    optimizer.step()
    errors_finite = all(bool(torch.isfinite(e).all()) for e in codec.errors.values())
    # every error, on every rank, is the one before the skipped step: what it sent was never applied
    errors_kept = codec.errors.keys() == before.keys() and all(torch.equal(codec.errors[k], before[k]) for k in before)
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), parameters))
    # the output layers' ops finish before the input layer's non-finite one: none may commit
    after = [t for k in sorted(codec.p_prev) for t in (codec.p_prev[k], codec.q_prev[k])]
    factors_kept = all(torch.equal(a, b) for a, b in zip(after, factors))
    # the skipped step is no codec step: the next is step 1 (a Q step), as if it had never been
    steps_kept = attached(model).sync_steps == 1
    attached(model).detach()
    return errors_finite, errors_kept, unchanged and factors_kept and steps_kept


def test_non_finite_gradients_never_enter_the_error_and_the_step_is_skipped_everywhere():
    assert run_local(non_finite_skipped, 2) == [(True, True, True)] * 2


def decoded_overflow_skipped(rank, world_size, compressor):
    """An fp16 layer whose gradient is C·s, C of entries ±1, equal on every rank: step 0 (s = 3·10⁴)
    trains; at step 1 (s = 6·10⁴) M + E holds entries near 9·10⁴, and its low-rank approximation,
    finite in fp32, decodes past fp16's range. That step is skipped as a non-finite one: no codec step, the
    error and factors as before it, the parameters unchanged. The shape is wide (16 × 64) so that
    the codecs' state after step 0 differs from their state at the start."""
    torch.manual_seed(0)
    model = nn.Linear(64, 16, bias=False).half()
    signs = torch.randint(0, 2, (16, 64), generator=torch.Generator().manual_seed(3)).half() * 2 - 1
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=1e-9), scheduler="wfbp",
                                     compressor={"type": compressor, "rank": 1, "min_compression_rate": 0},
                                     profile=profile_of(model), cost=COST, nonfinite="skip")
    sync = attached(model)

    def step(scale):
        optimizer.zero_grad()
        (model.weight * signs * scale).sum().backward()
        optimizer.step()

    def state():
        return [t.clone() for t in (*sync.codec.errors.values(),
                                    *getattr(sync.codec, "p_prev", {}).values(), *sync.codec.q_prev.values())]

    step(3e4)
    before, weight = state(), model.weight.detach().clone()
    step(6e4)
    kept = sync.sync_steps == 1 and all(torch.equal(a, b) for a, b in zip(state(), before))
    unchanged = torch.equal(model.weight, weight)
    step(-3e4)  # M + E is step 0's rank-1 approximation, negated: the step 1 the skipped one was not
    counted = sync.sync_steps == 2 and bool(torch.isfinite(model.weight).all())
    sync.detach()
    return kept, unchanged, counted


@pytest.mark.parametrize("compressor", ["acp_sgd", "powersgd"])
def test_a_step_whose_decoded_gradient_overflows_fp16_is_skipped_and_changes_nothing(compressor):
    assert run_local(decoded_overflow_skipped, 2, compressor) == [(True, True, True)] * 2


@pytest.mark.parametrize("name", ["acp_sgd", "powersgd"])
def test_a_step_whose_gradient_is_never_applied_leaves_the_error_as_it_was(name):
    """No rank used the tensor (encoded, never finished), or the step was skipped (finished, then
    settled as not applied): the next step starts from the error before it (nothing sent is lost
    from the feedback), and the error changes only when an applied step settles."""
    codec = compress.get(name, rank=2, min_compression_rate=0)
    codec.setup({"w": TensorSpec("w", 12 * 10, 4, (12, 10))}, 1, seed=3)
    generator = torch.Generator().manual_seed(0)
    parameter = nn.Parameter(torch.zeros(12, 10))
    parameter.grad = torch.randn(12, 10, generator=generator)
    for _ in codec.rounds(0):
        wire = codec.encode("w", parameter.grad, 0)
        codec.reduced_target("w", parameter, 0).copy_(wire)
        codec.finish("w", parameter, 0)
    codec.settle(applied=True)
    before = codec.errors["w"].clone()
    assert before.abs().sum() > 0
    codec.encode("w", None, 1)  # this rank has no gradient, and no rank used the tensor: no finish
    codec.settle(applied=True)
    parameter.grad = torch.randn(12, 10, generator=generator)
    for _ in codec.rounds(2):  # a step skipped for another tensor's inf
        wire = codec.encode("w", parameter.grad, 2)
        codec.reduced_target("w", parameter, 2).copy_(wire)
        codec.finish("w", parameter, 2)
    codec.settle(applied=False)
    assert torch.equal(codec.errors["w"], before)
    parameter.grad = torch.randn(12, 10, generator=generator)
    for _ in codec.rounds(2):  # the skipped step does not count: step 2 again
        wire = codec.encode("w", parameter.grad, 2)
        codec.reduced_target("w", parameter, 2).copy_(wire)
        codec.finish("w", parameter, 2)
        assert torch.equal(codec.errors["w"], before)  # until the step settles
    codec.settle(applied=True)
    assert not torch.equal(codec.errors["w"], before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalized_columns_are_orthonormal_even_from_a_rank_deficient_factor(rank, dtype):
    generator = torch.Generator().manual_seed(1)
    column = torch.randn(9, 1, generator=generator)
    for factor in (torch.zeros(9, rank), column.repeat(1, rank), torch.cat([column, torch.zeros(9, rank - 1)], 1)):
        basis = orthogonalize(factor.to(dtype)).float()
        tolerance = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
        assert torch.allclose(basis.T @ basis, torch.eye(rank), atol=tolerance)
        assert torch.equal(orthogonalize(factor.to(dtype)), orthogonalize(factor.to(dtype)))  # the same on every rank
        if factor.any():  # the factor's own direction comes first
            assert torch.allclose(basis[:, 0].abs(), (column / column.norm()).abs().reshape(-1), atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_a_batch_is_orthogonalised_as_each_of_its_matrices_alone(rank, dtype):
    generator = torch.Generator().manual_seed(2)
    factors = [torch.randn(9, rank, generator=generator).to(dtype) for _ in range(3)] + [torch.zeros(9, rank, dtype=dtype)]
    batch = orthogonalize(torch.stack(factors))
    for factor, basis in zip(factors, batch.unbind(0)):
        assert torch.equal(basis, orthogonalize(factor)) and basis.T.is_contiguous()  # column-major, as alone


def test_a_steps_queries_are_orthogonalised_once_per_shape_as_one_at_a_time(monkeypatch):
    """Three 40 × 30 matrices and one 50 × 30: on P steps the queries Orth(Q_prev) are 30 × r for
    all four, on Q steps Orth(P_prev) 40 × r for three and 50 × r for one."""
    from gradsync.compress import acp_sgd

    generator = torch.Generator().manual_seed(3)
    shapes = {"a": (40, 30), "b": (40, 30), "c": (40, 30), "d": (50, 30)}
    steps = [{name: torch.randn(shape, generator=generator) for name, shape in shapes.items()} for _ in range(4)]
    calls = []

    def counted(matrix, *args):
        calls.append(tuple(matrix.shape))
        return orthogonalize(matrix, *args)

    def decoded(codec):
        codec.setup(specs_of(steps[0]), 1, seed=4)
        return [powersgd_step(codec, gradients, step) for step, gradients in enumerate(steps)]

    monkeypatch.setattr(acp_sgd, "orthogonalize", counted)
    together = decoded(ACPSGD(rank=3))
    per_step = len(calls) / 4
    monkeypatch.setattr(ACPSGD, "_orthogonalise_alike", lambda *_: {})
    one_at_a_time = decoded(ACPSGD(rank=3))
    assert calls[:3] == [(4, 30, 3), (3, 40, 3), (50, 3)]  # P step: one batch; Q step: a batch and one alone
    assert per_step == 1.5 and len(calls) - 6 == 16  # then each of 4 steps asks 4 times, one matrix at a time
    for grads, grads_alone in zip(together, one_at_a_time):
        # to rounding: a product reads a query inside the batch's storage at another alignment
        assert all(torch.allclose(grads[name], grads_alone[name], rtol=0, atol=1e-5) for name in shapes)


@pytest.mark.parametrize("name", ["acp_sgd", "powersgd"])
@pytest.mark.parametrize("rank", [2, 4])
def test_one_all_zero_gradient_does_not_stop_compression(name, rank):
    """A zero gradient (a zero-initialised layer's first step) averages to zero factors: the next
    queries must still span something, or every later gradient would be compressed to zero."""
    codec = compress.get(name, rank=rank, min_compression_rate=0)
    codec.setup({"w": TensorSpec("w", 12 * 10, 4, (12, 10))}, 1, seed=3)
    generator = torch.Generator().manual_seed(0)
    norms = []
    for step in range(4):
        parameter = nn.Parameter(torch.zeros(12, 10))
        parameter.grad = torch.zeros(12, 10) if step == 0 else torch.randn(12, 10, generator=generator)
        for _ in codec.rounds(step):
            wire = codec.encode("w", parameter.grad, step)
            codec.reduced_target("w", parameter, step).copy_(wire)
            codec.finish("w", parameter, step)
        codec.settle(applied=True)
        norms.append(parameter.grad.norm().item())
    assert norms[0] == 0 and min(norms[1:]) > 0.1, norms


@pytest.mark.parametrize("name", ["acp_sgd", "powersgd"])
def test_a_non_finite_step_let_through_leaves_the_next_steps_finite(name):
    """nonfinite="ignore" (as under a GradScaler, which skips the step): the averaged factors of an
    overflowing step hold inf or NaN and must not become the next step's query or warm start."""
    codec = compress.get(name, rank=2, min_compression_rate=0)
    codec.setup({"w": TensorSpec("w", 12 * 10, 4, (12, 10))}, 1, seed=3)
    generator = torch.Generator().manual_seed(0)
    step = 0
    for attempt in range(4):
        gradient = torch.randn(12, 10, generator=generator) * (float("inf") if attempt == 0 else 1.0)
        parameter = nn.Parameter(torch.zeros(12, 10))
        parameter.grad = gradient
        for _ in codec.rounds(step):
            wire = codec.encode("w", parameter.grad, step)
            codec.reduced_target("w", parameter, step).copy_(wire)
            codec.finish("w", parameter, step)
        finite = bool(torch.isfinite(parameter.grad).all())
        assert finite == (attempt > 0), attempt
        codec.settle(applied=finite)
        step += finite


def test_fusion_thresholds_shrink_by_the_compression_rate():
    from gradsync.planners import bind

    mib = 1 << 20
    assert bind("ddp").scaled(0.01).options == {"bucket_cap_bytes": int(25 * mib * 0.01),
                                                "first_bucket_bytes": int(mib * 0.01)}
    assert bind("ddp", bucket_cap_bytes=1000).scaled(0.5).options["bucket_cap_bytes"] == 500
    assert bind("ddp", bucket_cap_bytes=1000).scaled(1.0).options == {"bucket_cap_bytes": 1000}
    assert bind("wfbp").scaled(0.01).options == {}


@pytest.mark.parametrize("step", [0, 1])  # a P step, then a Q step
def test_row_blocked_compression_follows_algorithm_2(step, monkeypatch):
    """With blocks of a few rows, the factor and E ← M + E − P·Qᵀ equal the unblocked formulas."""
    monkeypatch.setattr("gradsync.compress.low_rank.BLOCK_BYTES", 3 * 20 * 4)  # 3-row blocks of 30 × 20
    codec = ACPSGD(rank=2)
    codec.setup({"w": TensorSpec("w", 30 * 20, 4, (30, 20))}, 1, seed=3)
    generator = torch.Generator().manual_seed(2)
    if step:
        one_worker_step(codec, "w", torch.randn(30, 20, generator=generator), 0)
    error, gradient = codec.errors.get("w", torch.zeros(30, 20)).clone(), torch.randn(30, 20, generator=generator)
    wire = codec.encode("w", gradient, step)
    query, combined = codec.query["w"], gradient + error
    codec.reduced_target("w", nn.Parameter(torch.zeros(30, 20)), step).copy_(wire)
    codec.finish("w", nn.Parameter(torch.zeros(30, 20)), step)
    codec.settle(applied=True)  # the step is applied: its error becomes current
    if step == 0:
        p, q = combined @ query, query
        expected_wire = p
    else:
        p, q = query, combined.T @ query
        expected_wire = q
    assert torch.allclose(wire, expected_wire.reshape(-1), atol=1e-5)
    assert torch.allclose(codec.errors["w"], combined - p @ q.T, atol=1e-5)


def test_saved_state_continues_on_another_dtype():
    """A checkpoint holds the stored sum and the deferred factors; loaded where gradients are
    float64, both move to that dtype and the run continues with the same error feedback."""
    spec = {"w": TensorSpec("w", 30 * 20, 4, (30, 20))}
    codec = ACPSGD(rank=2)
    codec.setup(spec, 1, seed=5)
    generator = torch.Generator().manual_seed(4)
    for step in range(3):
        one_worker_step(codec, "w", torch.randn(30, 20, generator=generator), step)
    restored = ACPSGD(rank=2)
    restored.setup(spec, 1, seed=9)
    restored.load_state_dict(*codec.state_dict())
    gradient = torch.randn(30, 20, generator=generator)
    continued = one_worker_step(codec, "w", gradient, 3)
    resumed = one_worker_step(restored, "w", gradient.double(), 3)
    assert resumed.dtype == torch.float64
    assert torch.allclose(resumed, continued.double(), atol=1e-5)
    assert torch.allclose(restored.errors["w"], codec.errors["w"].double(), atol=1e-5)


def test_where_no_step_is_skipped_the_error_is_formed_in_place_with_the_same_results():
    """``may_skip_steps`` false (wrap's nonfinite="raise"): P and Q steps, and a step in which this
    rank has no gradient and no rank used the tensor, give the same gradients and errors bit for bit
    as the two-buffer codec, from one error buffer per matrix."""
    spec = {"w": TensorSpec("w", 40 * 30, 4, (40, 30))}
    codecs = [ACPSGD(rank=3), ACPSGD(rank=3)]
    codecs[1].may_skip_steps = False
    for codec in codecs:
        codec.setup(spec, 1, seed=2)
    generator = torch.Generator().manual_seed(4)
    for step in range(6):
        gradient = torch.randn(40, 30, generator=generator)
        if step == 3:
            for codec in codecs:  # encoded without a gradient, never finished
                codec.encode("w", None, step)
                codec.settle(applied=True)
            continue
        two_buffers, in_place = (one_worker_step(codec, "w", gradient, step) for codec in codecs)
        assert torch.equal(two_buffers, in_place)
        assert torch.equal(codecs[0].errors["w"], codecs[1].errors["w"])
    assert codecs[1].errors["w"].abs().max() > 1e-3
    assert not codecs[1].spares and codecs[0].spares

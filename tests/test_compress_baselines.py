"""The compression baselines as codecs: Power-SGD (acp-sgd Algorithm 1, left), EF-SignSGD with and
without majority vote, and Top-k. One-worker semantics and error-feedback conservation; on two
ranks, decoded gradients against uncompressed averaging (torch DDP) or against each rank's
gradients decoded by hand, bytes on the wire, checkpoints; bad input."""
import copy
import math
import random
import struct
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync import ConfigError, compress, planners
from gradsync.planning import plan_layouts, step_prediction
from gradsync.compress.acp_sgd import ACPSGD
from gradsync.compress.powersgd import PowerSGD
from gradsync.compress.signsgd import SignSGD
from gradsync.compress.quantize import MinMax8Bit
from gradsync.compress.topk import TopK, index_words, indices_from_words
from gradsync.launch import run_local
from gradsync.profile import LayerProfile, ModelProfile, TensorSpec
from gradsync.runtime import attached
from runtime_models import COST, TiedNet, batch, synthetic_profile


# -- one worker: world size 1 -------------------------------------------------------------------

def gathered_step(codec, name, gradient, step):
    """Encode, 'all-gather' on one worker (a (1, wire) stack), finish: the decoded gradient."""
    parameter = nn.Parameter(torch.zeros_like(gradient))
    wire = codec.encode(name, gradient, step)
    codec.reduced_target(name, parameter, step).copy_(wire.unsqueeze(0))
    codec.finish(name, parameter, step)
    codec.settle(applied=True)
    return parameter.grad


def powersgd_step(codec, gradients, step):
    """Each round of the step for every tensor (Power-SGD: P, then Q; ACP-SGD: its one), each
    'all-reduced' on one worker."""
    parameters = {name: nn.Parameter(torch.zeros_like(g)) for name, g in gradients.items()}
    for name, gradient in gradients.items():
        parameters[name].grad = gradient.clone()
    for _ in codec.rounds(step):
        for name, parameter in parameters.items():
            wire = codec.encode(name, parameter.grad, step)
            codec.reduced_target(name, parameter, step).copy_(wire)
            codec.finish(name, parameter, step)
    codec.settle(applied=True)
    return {name: parameter.grad for name, parameter in parameters.items()}


def specs_of(gradients):
    return {name: TensorSpec(name, g.numel(), g.element_size(), tuple(g.shape)) for name, g in gradients.items()}


@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=2), lambda: SignSGD(), lambda: TopK(density=0.05),
                                  lambda: MinMax8Bit(chunk=64)], ids=["powersgd", "signsgd", "topk", "minmax8"])
def test_error_feedback_conserves_the_gradient_sum(make):
    codec = make()
    shapes = {"w": (30, 20), "b": (30,)}
    codec.setup(specs_of({n: torch.zeros(s) for n, s in shapes.items()}), 1, seed=5)
    generator = torch.Generator().manual_seed(0)
    applied = {n: torch.zeros(s) for n, s in shapes.items()}
    total = {n: torch.zeros(s) for n, s in shapes.items()}
    for step in range(6):
        gradients = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
        if isinstance(codec, PowerSGD):
            decoded = powersgd_step(codec, gradients, step)
        else:
            decoded = {n: gathered_step(codec, n, g, step) for n, g in gradients.items()}
        for name in shapes:
            total[name] += gradients[name]
            applied[name] += decoded[name]
            error = codec.errors.get(name, torch.zeros(shapes[name])).view(shapes[name])
            # Σ applied_t + E_t = Σ M_t after every step
            assert torch.allclose(applied[name] + error, total[name], atol=1e-4)
    assert codec.errors["w"].abs().max() > 1e-2  # every codec is lossy on a random 30 × 20 matrix


# -- Power-SGD on one worker ---------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(8, 8), (8, 4, 2), (6, 10), (10, 6)])
def test_powersgd_at_full_rank_is_exact(shape):
    n, m = shape[0], math.prod(shape[1:])
    codec = PowerSGD(rank=min(n, m), min_compression_rate=0)
    codec.setup({"w": TensorSpec("w", n * m, 4, shape)}, 1, seed=1)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        gradient = torch.randn(shape, generator=generator)
        assert torch.allclose(powersgd_step(codec, {"w": gradient}, step)["w"], gradient, atol=1e-5)


def test_powersgd_rounds_and_wire_sizes():
    codec = PowerSGD(rank=4)
    specs = {
        "big": TensorSpec("big", 64 * 32, 4, (64, 32)),  # (64 + 32)·4·2 = 768 < 2048: compressed
        "small": TensorSpec("small", 8 * 8, 4, (8, 8)),  # (8 + 8)·4·2 = 128 ≥ 64: whole in round P
        "bias": TensorSpec("bias", 64, 4, (64,)),
    }
    codec.setup(specs, 2, seed=0)
    assert set(codec.shapes) == {"big"}
    assert codec.rounds(0) == ("P", "Q") and codec.layouts() == ("P", "Q")
    assert [PowerSGD(start_iter=2).rounds(s) for s in (1, 2)] == [("plain",), ("P", "Q")]
    assert [codec.wire_spec(specs["big"], layout).numel for layout in ("P", "Q")] == [64 * 4, 32 * 4]
    assert [codec.wire_spec(specs["small"], layout).numel for layout in ("P", "Q")] == [64, 1]
    assert [codec.wire_spec(specs["bias"], layout).numel for layout in ("P", "Q")] == [64, 1]


def test_powersgd_round_q_sends_nan_when_round_p_was_not_applied():
    """A step skipped in round P (its finish never ran) must be skipped by round Q's check too."""
    codec = PowerSGD(rank=2)
    generator = torch.Generator().manual_seed(2)
    gradients = {"w": torch.randn(16, 12, generator=generator), "b": torch.randn(16, generator=generator)}
    codec.setup(specs_of(gradients), 1, seed=0)
    for name, gradient in gradients.items():
        codec.encode(name, gradient, 0)  # round P, never finished
    for name, gradient in gradients.items():
        assert torch.isnan(codec.encode(name, gradient, 0)).all()  # round Q
    for name in gradients:
        codec.encode(name, None, 1)
        assert codec.encode(name, None, 1) is None  # no gradient on this rank: nothing to flag


def test_powersgd_prediction_counts_the_work_between_its_rounds():
    """Round P is decoded (Orth(P̄)) and round Q encoded ((M + E)ᵀ·P̂) on the computing thread
    between the two rounds' all-reduces: with modelled codec times the predicted step grows by
    exactly those two, and the thread's busy time with it."""
    spec = TensorSpec("fc.weight", 256 * 128, 4, (256, 128))
    profile = ModelProfile("fc", (LayerProfile("fc", (spec,), 1e-3, 2e-3, 0.0),))
    codec = PowerSGD(rank=4)
    codec.setup({spec.name: spec}, 2, seed=0)
    flops = 1e9
    plans = plan_layouts(profile, COST, planners.bind("wfbp"), codec, flops)
    assert plans["Q"].codec_seconds == codec.compute_seconds(spec, "Q", flops)
    between = codec.compute_seconds(spec, "P", flops)[1] + codec.compute_seconds(spec, "Q", flops)[0]
    assert between == pytest.approx((2 * 256 * 4 * 4 + 2 * 2 * 256 * 128 * 4) / flops)
    without = {layout: replace(entry, codec_seconds=(0.0, 0.0)) for layout, entry in plans.items()}
    counted, uncounted = step_prediction(plans, ("P", "Q"), COST), step_prediction(without, ("P", "Q"), COST)
    assert counted.time - uncounted.time == pytest.approx(between)
    assert counted.busy - uncounted.busy == pytest.approx(between)
    assert step_prediction(plans, ("P",), COST) == step_prediction(without, ("P",), COST)  # one round: in the layers


def test_powersgd_fresh_queries_change_every_step_and_agree_across_replicas():
    gradient = torch.randn(12, 10, generator=torch.Generator().manual_seed(4))
    first, second = PowerSGD(rank=2, warm_start=False, error_feedback=False), PowerSGD(rank=2, warm_start=False,
                                                                                       error_feedback=False)
    for codec in (first, second):
        codec.setup(specs_of({"w": gradient}), 1, seed=9)
    p_first = [first.encode("w", gradient, step) for step in (0, 1)]
    assert torch.equal(p_first[0], second.encode("w", gradient, 0))
    assert not torch.allclose(p_first[0], p_first[1])


# -- Sign-SGD and Top-k on one worker -------------------------------------------------------------

def test_signsgd_wire_is_the_sign_bits_then_the_scale():
    gradient = torch.tensor([0.5, -1.0, 0.0, 2.0, -0.25, 3.0, -3.0, 1.0, -2.0])
    codec = SignSGD()
    codec.setup(specs_of({"g": gradient}), 1, seed=0)
    wire = codec.encode("g", gradient, 0)
    scale = 12.75 / 9  # ‖g‖₁ / numel
    # bit i of byte j is g[8j + i] >= 0: elements 0, 2, 3, 5, 7 -> 1 + 4 + 8 + 32 + 128
    assert wire.tolist() == [173, 0, *struct.pack("<f", scale)]
    assert codec.wire_spec(TensorSpec("g", 9), "plain").numel == 2 + 4
    signs = torch.tensor([1.0, -1, 1, 1, -1, 1, -1, 1, -1])
    parameter = nn.Parameter(torch.zeros(9))
    codec.reduced_target("g", parameter, 0).copy_(wire.unsqueeze(0))
    codec.finish("g", parameter, 0)
    codec.settle(applied=True)
    assert torch.allclose(parameter.grad, scale * signs)
    assert torch.allclose(codec.errors["g"], gradient - scale * signs)  # E = p − s·sign(p)


def test_topk_sends_the_k_largest_magnitudes_and_their_indices():
    gradient = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 0.05, 3.0, -0.4, 0.0, 1.0])
    codec = TopK(density=0.3, error_feedback=False)
    codec.setup(specs_of({"g": gradient}), 1, seed=0)
    wire = codec.encode("g", gradient, 0)
    assert wire[:3].tolist() == [-5.0, 4.0, 3.0]
    assert wire[3:].view(torch.int32).tolist() == [1, 3, 6]
    expected = torch.zeros(10)
    expected[[1, 3, 6]] = torch.tensor([-5.0, 4.0, 3.0])
    assert torch.equal(gathered_step(codec, "g", gradient, 1), expected)


@pytest.mark.parametrize("density, numel, k", [(0.07, 100, 7), (0.01, 5, 1), (1, 13, 13), (0.5, 3, 2)])
def test_topk_k_is_the_ceiling_of_density_times_numel(density, numel, k):
    codec = TopK(density=density)
    codec.setup({"g": TensorSpec("g", numel, 4, (numel,))}, 2, seed=0)
    assert codec.k("g") == k and codec.wire_spec(TensorSpec("g", numel, 4), "plain").numel == 2 * k


@pytest.mark.parametrize("dtype, largest", [(torch.float16, 2**28 - 1), (torch.bfloat16, 2**28 - 1),
                                            (torch.float32, 0x7F800000 - 1), (torch.float64, 2**40)])
def test_topk_index_words_round_trip_and_read_as_finite_floats(dtype, largest):
    indices = torch.tensor([0, 1, 0x3FFF, 0x4000, 0x7C00, 0xFFFF, 2**23, largest])
    indices = indices[indices <= largest]
    words = index_words(indices, dtype)
    assert words.dtype == dtype and words.numel() == indices.numel() * (2 if dtype.itemsize == 2 else 1)
    assert bool(torch.isfinite(words).all())  # the runtime's non-finite check must not fire on indices
    assert torch.equal(indices_from_words(torch.stack([words, words])), torch.stack([indices, indices]))


@pytest.mark.parametrize("make", [lambda: SignSGD(), lambda: SignSGD(majority_vote=True), lambda: TopK(density=0.2)],
                         ids=["signsgd", "signsgd-majority", "topk"])
def test_non_finite_gradients_decode_non_finite_and_never_enter_the_error(make):
    codec = make()
    codec.setup({"g": TensorSpec("g", 20, 4, (20,))}, 1, seed=0)
    generator = torch.Generator().manual_seed(6)
    gathered_step(codec, "g", torch.randn(20, generator=generator), 0)
    before = codec.errors["g"].clone()
    bad = torch.randn(20, generator=generator)
    bad[7] = float("inf")
    assert not bool(torch.isfinite(gathered_step(codec, "g", bad, 1)).all())
    assert torch.equal(codec.errors["g"], before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("make", [lambda: SignSGD(), lambda: TopK(density=0.25)], ids=["signsgd", "topk"])
def test_other_float_dtypes_keep_the_conservation(make, dtype):
    codec = make()
    gradient = torch.randn(8, 6, generator=torch.Generator().manual_seed(3)).to(dtype)
    codec.setup(specs_of({"g": gradient}), 1, seed=0)
    decoded = gathered_step(codec, "g", gradient, 0)
    assert decoded.dtype == dtype
    # decoded + E = M up to rounding E and the scale to the dtype: a few units of its epsilon
    tolerance = 2 * torch.finfo(dtype).eps * gradient.abs().max().item()
    assert torch.allclose((decoded + codec.errors["g"].view(8, 6)).double(), gradient.double(), atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=2), lambda: ACPSGD(rank=2)], ids=["powersgd", "acp_sgd"])
def test_low_rank_codecs_form_16_bit_gradients_factors_in_fp32(make, dtype):
    """Entries near 2·10⁴, inside fp16's range, make factor entries (row sums against an orthonormal
    query, about √1024·10⁴) past it: in fp32 the factors and the error stay finite, travel as fp32,
    and the decoded gradient is the fp32 codec's on the same values, rounded once to the dtype."""
    generator = torch.Generator().manual_seed(7)
    gradients = [(torch.rand(64, 1024, generator=generator) * 4e4 - 2e4).to(dtype) for _ in range(4)]
    codec, reference = make(), make()
    codec.setup(specs_of({"w": gradients[0]}), 1, seed=3)
    reference.setup(specs_of({"w": gradients[0].float()}), 1, seed=3)
    for layout in codec.layouts():
        assert codec.wire_dtype(layout, dtype) == torch.float32
        assert codec.wire_spec(codec.specs["w"], layout).bytes_per_element == 4
    for step, gradient in enumerate(gradients):
        decoded = powersgd_step(codec, {"w": gradient}, step)["w"]
        expected = powersgd_step(reference, {"w": gradient.float()}, step)["w"]
        assert decoded.dtype == dtype and bool(torch.isfinite(decoded).all())
        assert torch.equal(decoded, expected.to(dtype))
    assert codec.errors["w"].dtype == torch.float32
    assert torch.equal(codec.errors["w"], reference.errors["w"])


@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=2), lambda: ACPSGD(rank=2), lambda: SignSGD(),
                                  lambda: TopK(density=0.25), lambda: MinMax8Bit(chunk=64)],
                         ids=["powersgd", "acp_sgd", "signsgd", "topk", "minmax8"])
def test_error_feedback_follows_a_loss_scale_change(make):
    """The same gradients under a dynamic loss scale (2¹⁰, then backed off to 2⁹, then grown to
    2¹¹), the error rescaled at each change: every decoded gradient is the unscaled run's times
    the scale (the codecs are scale-equivariant, and powers of two scale exactly)."""
    generator = torch.Generator().manual_seed(11)
    gradients = [torch.randn(16, 32, generator=generator) for _ in range(4)]
    scales = [2.0 ** 10, 2.0 ** 9, 2.0 ** 11, 2.0 ** 11]
    plain, scaled = make(), make()
    for codec in (plain, scaled):
        codec.setup(specs_of({"w": gradients[0]}), 1, seed=2)
    for step, (gradient, scale) in enumerate(zip(gradients, scales)):
        if step and scale != scales[step - 1]:
            scaled.rescale_errors(scale / scales[step - 1])
        expected = powersgd_step(plain, {"w": gradient}, step)["w"]
        decoded = powersgd_step(scaled, {"w": gradient * scale}, step)["w"]
        torch.testing.assert_close(decoded / scale, expected, rtol=1e-5, atol=1e-6)


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, options, field", [
    ("powersgd", {"rank": 0}, "rank"), ("powersgd", {"rank": 2.5}, "rank"),
    ("powersgd", {"min_compression_rate": -1}, "min_compression_rate"),
    ("powersgd", {"start_iter": -1}, "start_iter"), ("powersgd", {"warm_start": "yes"}, "warm_start"),
    ("powersgd", {"reuse": True}, "reuse"),
    ("signsgd", {"majority_vote": 1}, "majority_vote"), ("signsgd", {"error_feedback": None}, "error_feedback"),
    ("signsgd", {"scale": 2}, "scale"),
    ("topk", {"density": 0}, "density"), ("topk", {"density": 1.5}, "density"), ("topk", {"density": True}, "density"),
    ("topk", {"density": float("nan")}, "density"), ("topk", {"k": 10}, "k"),
])
def test_bad_options_name_the_field(name, options, field):
    with pytest.raises(ConfigError, match=field):
        compress.get(name, **options)


def test_torch_powersgd_option_names_are_accepted_as_aliases():
    codec = compress.get("powersgd", matrix_approximation_rank=2, start_powerSGD_iter=3, use_error_feedback=False,
                         warm_start=False)
    assert (codec.rank, codec.start_iter, codec.error_feedback, codec.warm_start) == (2, 3, False, False)
    assert compress.build({"type": "powersgd", "matrix_approximation_rank": 1}).rank == 1
    with pytest.raises(ConfigError, match="'matrix_approximation_rank' is another name for 'rank'"):
        compress.get("powersgd", rank=2, matrix_approximation_rank=2)
    with pytest.raises(ConfigError, match="matrix_approximation_rank"):  # an alias is checked as its option is
        compress.get("powersgd", matrix_approximation_rank=0)


@pytest.mark.parametrize("name", ["powersgd", "signsgd", "topk"])
def test_non_floating_gradients_are_refused_in_setup(name):
    with pytest.raises(ConfigError, match="floating point"):
        compress.get(name).setup({"flags": TensorSpec("flags", 64, 1, (8, 8))}, 2, seed=0)


def test_topk_refuses_half_precision_tensors_its_indices_cannot_address():
    with pytest.raises(ConfigError, match="more elements"):
        TopK().setup({"huge": TensorSpec("huge", 2**28 + 1, 2, (2**14, 2**14 + 1))}, 2, seed=0)


# -- on two ranks -------------------------------------------------------------------------------

def loss_of(model, rank, step):
    tokens, targets = batch(rank, step)
    return F.cross_entropy(model(tokens, use_rank0_branch=rank == 0), targets)


def seeded_model():
    torch.manual_seed(0)
    return TiedNet()


def wrapped(compressor, scheduler="wfbp", momentum=0.0, model=None, codec_seed=0, **options):
    """`model` wrapped with `compressor`; `codec_seed` seeds the Python RNG that wrap draws the
    codec's shared seed from (Power-SGD's initial Q depends on it)."""
    model = model or seeded_model()
    random.seed(codec_seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    return gradsync.wrap(model, optimizer, scheduler=scheduler, compressor=compressor,
                         profile=synthetic_profile(model), cost=COST, **options)


def gradient_gap_to_ddp(rank, compressor, scheduler, steps=3, **options) -> float:
    """Largest difference between the decoded gradients and torch DDP's averaged ones."""
    model = seeded_model()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    model, optimizer = wrapped(compressor, scheduler, model=model, **options)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    worst = 0.0
    for step in range(steps):
        for m, o in ((model, optimizer), (reference, reference_optimizer)):
            o.zero_grad()
            loss_of(m, rank, step).backward()
        optimizer.synchronize()
        for p, q in zip(model.parameters(), reference.parameters()):
            if (p.grad is None) != (q.grad is None):
                return math.inf
            if q.grad is not None:
                worst = max(worst, (p.grad - q.grad).abs().max().item())
        optimizer.step()
        reference_optimizer.step()
    attached(model).detach()
    return worst


def resume_gap(rank, compressor) -> float:
    """6 steps straight vs 3 steps, state_dict, fresh wrap, load_state_dict, 3 more steps."""
    def train(model, optimizer, steps):
        for step in steps:
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
            optimizer.step()

    model, optimizer = wrapped(compressor, "mg_wfbp", momentum=0.9)
    train(model, optimizer, range(6))
    optimizer.synchronize()
    straight = [p.detach().clone() for p in model.parameters()]
    attached(model).detach()
    model, optimizer = wrapped(compressor, "mg_wfbp", momentum=0.9)
    train(model, optimizer, range(3))
    state = copy.deepcopy((model.state_dict(), optimizer.state_dict()))  # a collective: every rank
    attached(model).detach()
    model, optimizer = wrapped(compressor, "mg_wfbp", momentum=0.9, codec_seed=1)  # the seed comes from the state
    model.load_state_dict(state[0])
    optimizer.load_state_dict(state[1])
    train(model, optimizer, range(3, 6))
    optimizer.synchronize()
    attached(model).detach()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), straight))


def wire_bytes_and_flags(compressor) -> dict:
    """Per layout: (bytes of the executor's buffers, flags in its plan: one per tensor of an op and
    one per op)."""
    model, _ = wrapped(compressor)
    sync = attached(model)
    result = {layout: (executor.wire_bytes(), sum(len(op.tensors()) + 1 for op in sync.installed.plans[layout].ops))
              for layout, executor in sync.installed.executors.items()}
    sync.detach()
    return result


def parameter_shapes() -> dict:
    return {name: tuple(p.shape) for name, p in TiedNet().named_parameters() if p.requires_grad}


def decoded_against_hand_computed(rank, compressor, expected_of, steps=3) -> float:
    """Each step: this rank's own gradient M_r (under no_sync), then the synchronised one; every
    rank's p_r = M_r + E_r is gathered and `expected_of(ps, name)` decodes it by hand; E_r is kept
    by hand with `expected_of.error(p)`. Returns the largest gap to the runtime's gradients."""
    model, optimizer = wrapped(compressor)
    errors, worst = {}, 0.0
    for step in range(steps):
        optimizer.zero_grad()
        with gradsync.no_sync(model):
            loss_of(model, rank, step).backward()
        own = {n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        optimizer.synchronize()
        corrected = {n: own.get(n, 0) + errors.get(n, 0) for n in own.keys() | errors.keys()}
        everyone = [None, None]
        dist.all_gather_object(everyone, corrected)
        for name, parameter in model.named_parameters():
            ps = [c[name] for c in everyone if name in c]
            if not ps:
                worst = max(worst, 0.0 if parameter.grad is None else math.inf)
                continue
            expected = expected_of(ps, parameter.numel())
            worst = max(worst, (parameter.grad.reshape(-1) - expected).abs().max().item())
        errors = {n: expected_of.error(p) for n, p in corrected.items()}
        optimizer.step()
    attached(model).detach()
    return worst


class SignMean:
    """(1/W)·Σ_r s_r·sign(p_r), s_r = ‖p_r‖₁/n, sign(0) = +1; absent ranks add zero."""

    def __call__(self, ps, numel):
        return sum(p.abs().sum() / numel * torch.where(p >= 0, 1.0, -1.0) for p in ps) / 2

    @staticmethod
    def error(p):
        return p - p.abs().mean() * torch.where(p >= 0, 1.0, -1.0)


class SignMajority(SignMean):
    """Element by element: the vote of the ranks with a gradient, times the mean scale over both."""

    def __call__(self, ps, numel):
        mean_scale = sum(p.abs().sum().item() / numel for p in ps) / 2
        decoded = torch.zeros(numel)
        for i in range(numel):
            votes = sum(1 if p[i] >= 0 else -1 for p in ps)
            decoded[i] = (votes > 0) - (votes < 0)
        return decoded * mean_scale


class TopKByHand:
    """(1/W)·Σ_r sparse_r, sparse_r = p_r on its k largest magnitudes (by a full sort)."""

    def __init__(self, density):
        self.density = density

    def sparse(self, p):
        k = max(1, math.ceil(self.density * p.numel()))
        keep = torch.sort(p.abs(), descending=True, stable=True).indices[:k]
        sparse = torch.zeros_like(p)
        sparse[keep] = p[keep]
        return sparse

    def __call__(self, ps, numel):
        return sum(self.sparse(p) for p in ps) / 2

    def error(self, p):
        return p - self.sparse(p)


class MinMaxByHand:
    """(1/W)·Σ_r dequantised(p_r): each chunk of p at min + round((x − min)/s)·s, s = (max − min)/255."""

    def __init__(self, chunk):
        self.chunk = chunk

    def dequantised(self, p):
        out = torch.empty_like(p)
        for start in range(0, p.numel(), self.chunk):
            x = p[start:start + self.chunk]
            low, scale = x.min(), (x.max() - x.min()) / 255
            out[start:start + self.chunk] = low + (torch.round((x - low) / scale) * scale if scale > 0 else 0)
        return out

    def __call__(self, ps, numel):
        return sum(self.dequantised(p) for p in ps) / 2

    def error(self, p):
        return p - self.dequantised(p)


def parameter_gap_to_torch_hook(rank, compressor, hook, steps=30) -> float:
    """Largest parameter difference, relative to the largest parameter, between `compressor`
    under wrap and torch DDP with its communication hook `hook`, after `steps` steps."""
    model = seeded_model()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    reference.register_comm_hook(None, hook)
    model, optimizer = wrapped(compressor, model=model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        for m, o in ((model, optimizer), (reference, reference_optimizer)):
            o.zero_grad()
            loss_of(m, rank, step).backward()
            o.step()
    optimizer.synchronize()
    attached(model).detach()
    ours, theirs = (torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (model, reference))
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def powersgd_error_against_the_average(rank, steps=3) -> float:
    """Largest gap between the decoded gradient and (1/W)·Σ_r (M_r + E_r − E'_r): equal when each
    rank's error is taken against the aggregated approximation P̂·Q̄ᵀ (the torch hook's rule)."""
    model, optimizer = wrapped({"type": "powersgd", "rank": 2})
    codec, worst = attached(model).codec, 0.0
    for step in range(steps):
        optimizer.zero_grad()
        with gradsync.no_sync(model):
            loss_of(model, rank, step).backward()
        own = {n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters() if p.grad is not None}
        before = {n: e.reshape(-1).clone() for n, e in codec.errors.items()}
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        optimizer.synchronize()
        removed = {n: own.get(n, 0) + before.get(n, 0) - e.reshape(-1) for n, e in codec.errors.items()}
        everyone = [None, None]
        dist.all_gather_object(everyone, removed)
        for name, parameter in model.named_parameters():
            if name in codec.shapes and parameter.grad is not None:
                average = sum(r[name] for r in everyone if name in r) / 2
                worst = max(worst, (parameter.grad.reshape(-1) - average).abs().max().item())
        optimizer.step()
    attached(model).detach()
    return worst


def skipped_step_changes_nothing(rank, compressor, poisoned: str) -> bool:
    """nonfinite="skip" with a NaN gradient in module `poisoned` on rank 1: on both ranks the
    parameters stay, every error stays finite, and rank 1's error of that module stays."""
    model, optimizer = wrapped(compressor, nonfinite="skip")
    codec = attached(model).codec
    loss_of(model, rank, 0).backward()
    optimizer.step()
    parameters = [p.detach().clone() for p in model.parameters()]
    errors = {n: e.clone() for n, e in codec.errors.items()}
    optimizer.zero_grad()
    loss = loss_of(model, rank, 1)
    if rank == 1:
        loss = loss + getattr(model, poisoned).weight.sum() * float("nan")
    loss.backward()
    optimizer.step()
    kept = all(torch.equal(p, q) for p, q in zip(model.parameters(), parameters))
    finite = all(bool(torch.isfinite(e).all()) for e in codec.errors.values())
    name = f"{poisoned}.weight"
    own_kept = rank == 0 or name not in errors or torch.equal(codec.errors[name], errors[name])
    attached(model).detach()
    return kept and finite and own_kept


def powersgd_on_two_ranks(rank, world_size):
    return {
        "error_identity": powersgd_error_against_the_average(rank),
        # full rank (16 = min(n, m) of every matrix), factors split over several us_byte ops
        "full_rank_us_byte": gradient_gap_to_ddp(rank, {"type": "powersgd", "rank": 16, "min_compression_rate": 0},
                                                 "us_byte", partition_bytes=256),
        # the torch hook's 'after backward' variant: one bucket holding the whole model
        "full_rank_one_bucket": gradient_gap_to_ddp(rank, {"type": "powersgd", "rank": 16,
                                                           "min_compression_rate": 0},
                                                    "ddp", bucket_cap_bytes=2**30, first_bucket_bytes=2**30),
        "bytes": wire_bytes_and_flags({"type": "powersgd", "rank": 4}),
        "bytes_float16": wire_bytes_and_flags({"type": "powersgd", "rank": 4, "wire_dtype": "float16"}),
        # every factor and whole tensor cast to float16 on the wire; exact otherwise (full rank)
        "full_rank_float16": gradient_gap_to_ddp(rank, {"type": "powersgd", "rank": 16, "min_compression_rate": 0,
                                                        "wire_dtype": "float16"}, "wfbp"),
        "full_rank_bfloat16": gradient_gap_to_ddp(rank, {"type": "powersgd", "rank": 16, "min_compression_rate": 0,
                                                         "wire_dtype": "bfloat16"}, "wfbp"),
        "acp_bytes": [wire_bytes_and_flags({"type": "acp_sgd", "wire_dtype": wire}) for wire in (None, "bfloat16")],
        "resume": resume_gap(rank, {"type": "powersgd", "rank": 2}),
        # norm.weight travels uncompressed (round P only), conv.weight compressed
        "skip": [skipped_step_changes_nothing(rank, {"type": "powersgd", "rank": 2}, module)
                 for module in ("norm", "conv")],
        "resume_fresh_queries": resume_gap(rank, {"type": "powersgd", "rank": 2, "warm_start": False}),
    }


def signsgd_on_two_ranks(rank, world_size):
    return {
        "mean": decoded_against_hand_computed(rank, "signsgd", SignMean()),
        "majority": decoded_against_hand_computed(rank, {"type": "signsgd", "majority_vote": True}, SignMajority()),
        "bytes": wire_bytes_and_flags("signsgd"),
        "resume": resume_gap(rank, "signsgd"),
        "skip": [skipped_step_changes_nothing(rank, "signsgd", "conv")],
    }


def topk_on_two_ranks(rank, world_size):
    return {
        "hand": decoded_against_hand_computed(rank, {"type": "topk", "density": 0.2}, TopKByHand(0.2)),
        "density_one": gradient_gap_to_ddp(rank, {"type": "topk", "density": 1.0}, "optimal_merge"),
        "bytes": wire_bytes_and_flags({"type": "topk", "density": 0.1}),
        "resume": resume_gap(rank, {"type": "topk", "density": 0.1}),
        "skip": [skipped_step_changes_nothing(rank, {"type": "topk", "density": 0.1}, "conv")],
    }


def minmax8_on_two_ranks(rank, world_size):
    return {
        "hand": decoded_against_hand_computed(rank, {"type": "minmax8", "chunk": 64}, MinMaxByHand(64)),
        "bytes": wire_bytes_and_flags({"type": "minmax8", "chunk": 64}),
        "resume": resume_gap(rank, {"type": "minmax8", "chunk": 64}),
        "skip": [skipped_step_changes_nothing(rank, "minmax8", "conv")],
    }


def bfloat16_wire_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook, which DDP accepts (by its name) only on CUDA with NCCL: the bucket
    cast to bfloat16 and divided by the world size, all-reduced, cast back."""
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size())

    def decompressed(future):
        bucket.buffer().copy_(future.value()[0])
        return bucket.buffer()

    return dist.all_reduce(compressed, async_op=True).get_future().then(decompressed)


def casts_on_two_ranks(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"fp16_vs_torch": parameter_gap_to_torch_hook(rank, "fp16", default_hooks.fp16_compress_hook),
            "bf16_vs_torch": parameter_gap_to_torch_hook(rank, "bf16", bfloat16_wire_hook),
            "fp16_bytes": wire_bytes_and_flags("fp16"), "bf16_bytes": wire_bytes_and_flags("bf16")}


def every_codec_on_two_ranks(rank, world_size):
    return {"powersgd": powersgd_on_two_ranks(rank, world_size), "signsgd": signsgd_on_two_ranks(rank, world_size),
            "topk": topk_on_two_ranks(rank, world_size), "minmax8": minmax8_on_two_ranks(rank, world_size),
            "casts": casts_on_two_ranks(rank, world_size)}


@pytest.fixture(scope="module")
def two_ranks():
    """One launch for every two-rank check: starting the processes costs more than the checks."""
    return run_local(every_codec_on_two_ranks, 2)


@pytest.fixture(scope="module")
def powersgd_runs(two_ranks):
    return [run["powersgd"] for run in two_ranks]


@pytest.fixture(scope="module")
def signsgd_runs(two_ranks):
    return [run["signsgd"] for run in two_ranks]


@pytest.fixture(scope="module")
def topk_runs(two_ranks):
    return [run["topk"] for run in two_ranks]


@pytest.fixture(scope="module")
def minmax8_runs(two_ranks):
    return [run["minmax8"] for run in two_ranks]


@pytest.fixture(scope="module")
def cast_runs(two_ranks):
    return [run["casts"] for run in two_ranks]


def test_powersgd_at_full_rank_equals_uncompressed_averaging(powersgd_runs):
    for run in powersgd_runs:
        assert run["full_rank_us_byte"] < 1e-5 and run["full_rank_one_bucket"] < 1e-5


def test_low_rank_factors_cast_on_the_wire_stay_within_its_rounding(powersgd_runs):
    for run in powersgd_runs:
        assert 0 < run["full_rank_float16"] < 1e-3 and 0 < run["full_rank_bfloat16"] < 1e-2
        as_gradients, in_bfloat16 = run["acp_bytes"]
        assert set(as_gradients) == {"P", "Q"} and all(
            in_bfloat16[layout] == (as_gradients[layout][0] // 2, as_gradients[layout][1]) for layout in as_gradients)


def test_powersgd_error_is_taken_against_the_aggregated_approximation(powersgd_runs):
    assert all(run["error_identity"] < 1e-5 for run in powersgd_runs)


def test_signsgd_decodes_the_mean_of_every_ranks_scaled_signs(signsgd_runs):
    assert all(run["mean"] < 1e-6 for run in signsgd_runs)


def test_signsgd_majority_vote_matches_brute_force(signsgd_runs):
    assert all(run["majority"] < 1e-6 for run in signsgd_runs)


def test_topk_decodes_the_average_of_every_ranks_sparse_vector(topk_runs):
    assert all(run["hand"] < 1e-6 for run in topk_runs)


def test_topk_at_density_one_equals_uncompressed_averaging(topk_runs):
    assert all(run["density_one"] < 1e-6 for run in topk_runs)


def test_bytes_on_the_wire_equal_the_formula(powersgd_runs, signsgd_runs, topk_runs):
    shapes = parameter_shapes()
    numel = {name: math.prod(shape) for name, shape in shapes.items()}
    # Power-SGD, rank 4, min_compression_rate 2: embed.weight (24 × 16: 40·8 < 384) and conv.weight
    # (16 × 48: 64·8 < 768) are compressed; the 16 × 16 linears (32·8 = 256) and vectors are not
    compressed = {"embed.weight": (24, 16), "conv.weight": (16, 48)}
    assert all((shapes[n][0], numel[n] // shapes[n][0]) == nm for n, nm in compressed.items())
    plain = [n for n in shapes if n not in compressed]
    (p_bytes, p_flags), (q_bytes, q_flags) = (powersgd_runs[0]["bytes"][layout] for layout in ("P", "Q"))
    assert p_bytes == 4 * (sum(n * 4 for n, _ in compressed.values()) + sum(numel[n] for n in plain) + p_flags)
    assert q_bytes == 4 * (sum(m * 4 for _, m in compressed.values()) + len(plain) + q_flags)
    for layout, fp32_bytes in (("P", p_bytes), ("Q", q_bytes)):  # wire_dtype float16: every element in 2 bytes
        assert powersgd_runs[0]["bytes_float16"][layout] == (fp32_bytes // 2, (p_flags, q_flags)[layout == "Q"])
    # Sign-SGD: ceil(n / 8) + 4 bytes per tensor, uint8 flags (one per tensor per op, one per op)
    sign_bytes, sign_flags = signsgd_runs[0]["bytes"]["plain"]
    assert sign_bytes == sum(math.ceil(n / 8) + 4 for n in numel.values()) + sign_flags
    # Top-k: k fp32 values and k int32 indices, k = ceil(0.1·n)
    topk_bytes, topk_flags = topk_runs[0]["bytes"]["plain"]
    assert topk_bytes == 4 * (sum(2 * math.ceil(0.1 * n) for n in numel.values()) + topk_flags)


def test_minmax8_decodes_the_mean_of_every_ranks_dequantised_chunks(minmax8_runs):
    assert all(run["hand"] < 1e-6 for run in minmax8_runs)


def test_minmax8_and_the_casts_send_their_formula_bytes(minmax8_runs, cast_runs):
    numel = {name: math.prod(shape) for name, shape in parameter_shapes().items()}
    total = sum(numel.values())
    minmax_bytes, minmax_flags = minmax8_runs[0]["bytes"]["plain"]  # 1 byte each, 8 per chunk of 64, uint8 flags
    assert minmax_bytes == sum(n + 8 * math.ceil(n / 64) for n in numel.values()) + minmax_flags
    assert 0.25 < (minmax_bytes - minmax_flags) / (4 * total) < 0.3  # about a quarter of float32
    for key in ("fp16_bytes", "bf16_bytes"):  # 2 bytes per element and per flag: half of float32
        cast_bytes, cast_flags = cast_runs[0][key]["plain"]
        assert cast_bytes == 2 * (total + cast_flags)


def test_half_precision_wires_follow_torchs_compression_hooks_over_30_steps(cast_runs):
    for run in cast_runs:
        assert run["fp16_vs_torch"] < 1e-3 and run["bf16_vs_torch"] < 1e-3


def test_checkpoint_resume_continues_identically(powersgd_runs, signsgd_runs, topk_runs, minmax8_runs):
    for runs in (powersgd_runs, signsgd_runs, topk_runs, minmax8_runs):
        assert [run["resume"] for run in runs] == [0.0, 0.0]
    assert [run["resume_fresh_queries"] for run in powersgd_runs] == [0.0, 0.0]


def test_wire_profile_carries_the_codec_sizes():
    model = TiedNet()
    profile = synthetic_profile(model)
    for codec, per_tensor in ((SignSGD(), lambda n: math.ceil(n / 8) + 4), (TopK(density=0.1),
                                                                              lambda n: 8 * math.ceil(0.1 * n))):
        codec.setup(profile.tensor_map(), 2, seed=0)
        wire = compress.wire_profile(profile, codec, "plain", flops_per_second=1e12)
        assert wire.total_bytes == sum(per_tensor(t.numel) for t in profile.tensors())
        assert wire.backward_time > profile.backward_time and wire.forward_time > profile.forward_time


def test_a_step_with_non_finite_gradients_is_skipped_on_every_rank(powersgd_runs, signsgd_runs, topk_runs,
                                                                   minmax8_runs):
    for runs in (powersgd_runs, signsgd_runs, topk_runs, minmax8_runs):
        assert all(all(run["skip"]) for run in runs)

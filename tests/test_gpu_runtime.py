"""The runtime and the codecs on a CUDA GPU (marked `gpu`: skipped elsewhere, run by `make gpu-check`).

- The low-rank codecs on CUDA tensors (the compiled Triton error-feedback kernel) follow the same
  codec on the CPU (the torch reference), step for step; their orthogonalisation on CUDA (QR at
  every rank) gives the CPU's columns and never waits for the device.
- `gradsync.wrap` on NCCL with one rank, profile and cost measured (every measurement collective on
  the device), and on two ranks sharing the GPU over gloo with CUDA tensors: every scheduler kind
  (auto with its plan trials, deferred updates, simultaneous channels) and ACP-SGD at full rank on
  square matrices (exact, so comparable) reach torch DDP's parameters.
"""
import copy
import time

import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync import compress
from gradsync.compress.orthogonalize import orthogonalize
from gradsync.launch import run_local
from gradsync.profile import TensorSpec
from gradsync.runtime import attached
from runtime_models import TiedNet, batch, distance
from test_acp_sgd import data, square_net
from test_compress_baselines import powersgd_step

pytestmark = pytest.mark.gpu

STEPS = 48  # past the measured iterations and auto's plan trials (4 rounds: 33 iterations)
TOLERANCE = 1e-4


def _tied_loss(model, rank: int, step: int):
    tokens, targets = (t.cuda() for t in batch(rank, step))
    return F.cross_entropy(model(tokens, use_rank0_branch=rank == 0), targets)


def _square_loss(model, rank: int, step: int):
    inputs, targets = (t.cuda() for t in data(rank, step))
    return F.cross_entropy(model(inputs), targets)


# label: (model, loss, wrap options); the scheduler is the label unless the options name one
RUNS = {
    "auto": (TiedNet, _tied_loss, {"trial_seconds": 0.05}),
    "us_byte": (TiedNet, _tied_loss, {"partition_bytes": 256}),  # forward-phase ops: deferred updates
    "asc_wfbp": (TiedNet, _tied_loss, {"channels": 2}),
    # square matrices at full rank: ACP-SGD is exact, so it must reach DDP's parameters
    "acp_sgd": (square_net, _square_loss, {"scheduler": "optimal_merge",
                                           "compressor": {"type": "acp_sgd", "rank": 8, "min_compression_rate": 0}}),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("name", ["acp_sgd", "powersgd"])
def test_low_rank_codecs_on_cuda_follow_the_cpu(name, record_property):
    shapes = {"wide": (64, 300), "tall": (500, 48), "wide_too": (64, 300)}  # ACP-SGD stacks the two wide ones
    generator = torch.Generator().manual_seed(11)
    gradients = [{key: torch.randn(shape, generator=generator) for key, shape in shapes.items()} for _ in range(6)]
    specs = {key: TensorSpec(key, n * m, 4, (n, m)) for key, (n, m) in shapes.items()}
    codecs = {device: compress.get(name, rank=4) for device in ("cpu", "cuda")}
    for codec in codecs.values():
        codec.setup(specs, 1, seed=3)
    worst = 0.0
    for step, step_gradients in enumerate(gradients):  # every round of the step, on one worker
        on_cpu = powersgd_step(codecs["cpu"], step_gradients, step)
        on_cuda = powersgd_step(codecs["cuda"], {key: g.cuda() for key, g in step_gradients.items()}, step)
        worst = max(worst, *(relative_error(on_cuda[key].cpu(), on_cpu[key]) for key in shapes))
    record_property("largest_relative_error", worst)
    assert worst < TOLERANCE


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalize_on_cuda_matches_the_cpu_and_never_waits(rank):
    """The CPU's Gram–Schmidt (ranks 1 and 2) or QR, within fp32 rounding, on full-rank factors;
    orthonormal columns from rank-deficient ones; and issued while the device is still busy with
    a queued sleep (a test of a column's norm on the host would wait for it)."""
    generator = torch.Generator().manual_seed(5)
    factor = torch.randn(500, rank, generator=generator)
    assert torch.allclose(orthogonalize(factor.cuda()).cpu(), orthogonalize(factor), atol=1e-5)
    column = factor[:, :1]
    for deficient in (torch.zeros(500, rank), column.repeat(1, rank)):
        basis = orthogonalize(deficient.cuda())
        assert torch.allclose(basis.T @ basis, torch.eye(rank, device="cuda"), atol=1e-5)
    on_device = factor.cuda()
    orthogonalize(on_device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    began = time.perf_counter()
    orthogonalize(on_device)
    issued = time.perf_counter() - began
    torch.cuda.synchronize()
    assert issued < 0.5 * start.elapsed_time(end) * 1e-3, issued


def trains_like_ddp_on_cuda(rank, world_size, runs):
    """Per run of RUNS: the largest difference from torch DDP's parameters after STEPS steps on
    cuda:0, whether the measurement (and auto's trials) had ended, the planner that ran last and the
    number of its ops."""
    torch.cuda.set_device(0)
    results = {}
    for label in runs:
        build, loss, options = RUNS[label]
        torch.manual_seed(0)
        model = build().cuda()
        reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
        model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         **{"scheduler": label, "warmup_iterations": 1, "measure_iterations": 2,
                                            "timeout": 120, **options})
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            for network, stepper in ((model, optimizer), (reference, ref_optimizer)):
                stepper.zero_grad()
                loss(network, rank, step).backward()
                stepper.step()
        optimizer.synchronize()
        sync = attached(model)
        results[label] = (distance(model, reference), sync.measurement is None, sync.plan.planner, len(sync.plan.ops))
        sync.detach()
    return results


def _check(results_per_rank, record_property):
    for rank, results in enumerate(results_per_rank):
        for label, (difference, measured, planner, ops) in results.items():
            record_property(f"rank{rank}/{label}", f"{difference:.3g} from DDP ({planner}, {ops} ops)")
            assert measured, label  # the plan made on the measured profile ran
            assert difference < TOLERANCE, (rank, label, difference)


def test_wrap_on_nccl_with_one_rank_trains_like_ddp(record_property):
    _check(run_local(trains_like_ddp_on_cuda, 1, tuple(RUNS), backend="nccl"), record_property)


def test_wrap_on_two_ranks_sharing_the_gpu_over_gloo_trains_like_ddp(record_property):
    _check(run_local(trains_like_ddp_on_cuda, 2, tuple(RUNS), backend="gloo"), record_property)

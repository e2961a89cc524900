"""A 2-rank DeepSpeed job for tests/test_deepspeed.py, started by the ``deepspeed`` launcher on CPU:

    DS_ACCELERATOR=cpu deepspeed --num_accelerators 2 --master_port P tests/deepspeed_job.py --out DIR

1. ``us_byte`` uncompressed, gradient accumulation 2, without and with gradient clipping (DeepSpeed
   clips at 1.0 by default): DeepSpeed's engine with gradsync beside a DistributedDataParallel
   reference run on the same batches in this process; the first writes to DeepSpeed's csv monitor;
2. ``acp_sgd`` with gradient clipping: losses, replica agreement, and a checkpoint round trip
   through ``engine.save_checkpoint``/``load_checkpoint`` replayed on the same batches (this run
   probes the network for its cost model at the start; every other run reads DIR/cost.json);
3. ``"nonfinite": "skip"`` with a NaN batch on rank 1, beside plain DeepSpeed (no gradsync section)
   on the same batches without that one, both with a warm-up LR schedule;
4. every non-compressing scheduler at ZeRO stages 0 (fp32 and bf16), 1 and 2 (bf16; and fp32 with
   one), with gradient accumulation and clipping, beside DeepSpeed's own run of the same config; and
   at stage 2 in fp32 a NaN in one micro-batch, skipped as DeepSpeed skips it, and steps of two
   backward passes (DeepSpeed's ``coalesce_grad_reduction``, refused; boundaries marked instead);
5. ``acp_sgd`` under ZeRO stages 1 and 2, and at stage 0 in bf16: training, replicas, and a
   checkpoint round trip;
6. fp16 under ZeRO stage 2 with overflowing first steps, and at stage 0 with an overflowing batch,
   beside DeepSpeed's own run;
7. a layer that no rank uses on every other step, SGD with momentum and weight decay, at stage 0 in
   fp32 (where the user's optimizer steps it), beside DeepSpeed's own run;
8. a layer frozen at ``deepspeed.initialize`` and unfrozen later, at stage 0 in fp32, beside
   DeepSpeed's own run.
Every engine comes from plain ``deepspeed.initialize``, with gradsync imported after deepspeed.
On the CPU, DeepSpeed's communication backend starts without its shared-memory op (see
``without_shared_memory_op``).
With ``--cuda`` (one process per GPU, NCCL) the job runs 6 alone, for the GPU acceptance run.
Rank 0 writes what it measured to DIR/result.json; the test holds the expectations.
"""
from __future__ import annotations

import argparse
import importlib
import json
import random
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils.logging import set_log_level_from_string
from torch import nn

import gradsync  # noqa: F401  (after deepspeed: its engine honours the "gradsync" section from here on)
from gradsync.deepspeed import gather, zero
from gradsync.plan import FORWARD

MICRO_BATCH, FEATURES, OUTPUTS = 8, 8, 4
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 10}}
QUIET = {"steps_per_print": 10**9, "wall_clock_breakdown": False}
gather.PIECE_BYTES = 256  # ZeRO's parameter all-gather in several pieces even for this small model
HOST_MEMORY_RELEASES = []  # one entry per release by gradsync's ZeRO step
_release = zero.release_freed_host_memory


def _counted_release() -> None:
    HOST_MEMORY_RELEASES.append(None)
    _release()


zero.release_freed_host_memory = _counted_release


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, OUTPUTS))


def batch(rank: int, step: int):
    """Rank `rank`'s batch `step` of a fixed linear regression task."""
    truth = torch.Generator().manual_seed(7)
    weight = torch.randn(FEATURES, OUTPUTS, generator=truth)
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(MICRO_BATCH, FEATURES, generator=generator)
    return x, x @ weight


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def micro_step(engine, rank: int, step: int) -> float:
    x, y = batch(rank, step)
    loss = nn.functional.mse_loss(engine(x.to(next(engine.module.parameters()).dtype)).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def ddp_reference(rank: int, steps: int, accumulation: int, clipping: float) -> torch.Tensor:
    """SGD on DistributedDataParallel with the same batches, accumulating and clipping the
    averaged gradients' norm like DeepSpeed."""
    model = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), **SGD["params"])
    for step in range(steps):
        for micro in range(accumulation):
            x, y = batch(rank, step * accumulation + micro)
            context = ddp.no_sync() if micro < accumulation - 1 else torch.enable_grad()
            with context:
                (nn.functional.mse_loss(ddp(x), y) / accumulation).backward()
        if clipping:
            nn.utils.clip_grad_norm_(model.parameters(), clipping)
        optimizer.step()
        optimizer.zero_grad()
    return flat(model)


def uncompressed_equivalence(rank: int, cost_path: str, clipping: float, transport: dict,
                             monitor: Path | None = None) -> dict:
    """With `monitor`, DeepSpeed's csv monitor writes there (rank 0), and what it wrote is returned."""
    accumulation, steps = 2, 8
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": clipping, "optimizer": SGD, **QUIET,
              "gradsync": {"scheduler": "us_byte", "channels": 2, "cost": cost_path, **transport}}
    if monitor is not None:
        config["csv_monitor"] = {"enabled": True, "output_path": str(monitor), "job_name": "us_byte"}
    model = mlp()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for micro in range(steps * accumulation):
        micro_step(engine, rank, micro)
    optimizer.synchronize()
    difference = (flat(engine.module) - ddp_reference(rank, steps, accumulation, clipping)).abs().max().item()
    result = {"max_abs_difference_to_ddp": difference, "global_steps": engine.global_steps,
              "synchronised_backward_passes": engine.gradsync.sync_steps,
              "forward_phase_ops": sum(op.phase == FORWARD for op in engine.gradsync.plan.ops),
              "backward_allreduce": engine.enable_backward_allreduce,
              "transport": engine.gradsync.channels.transport,
              "engine_class": type(engine).__name__}
    if monitor is not None and rank == 0:
        result["monitor"] = {path.stem: path.read_text().splitlines() for path in (monitor / "us_byte").glob("*.csv")}
    engine.destroy()
    return result


def compressed_with_checkpoint(rank: int, directory: Path, stage: int = 0, precision: str = "fp32",
                               cost_path: str | None = None) -> dict:
    """`cost_path`: the cost model's file; None, the section's default (the network probed at the
    start). wfbp's plan is the same whatever the cost."""
    steps, saved_at, replay = 24, 16, 4
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0, "optimizer": SGD, **QUIET,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "gradsync": {"scheduler": "wfbp", "compressor": {"type": "acp_sgd", "rank": 2},
                           **({"cost": cost_path} if cost_path else {})},
              **({precision: {"enabled": True}} if precision != "fp32" else {})}
    model = mlp()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    releases_before = len(HOST_MEMORY_RELEASES)
    losses = []
    for step in range(saved_at):
        losses.append(micro_step(engine, rank, step))
    engine.save_checkpoint(str(directory), tag="mid")
    for step in range(saved_at, saved_at + replay):
        losses.append(micro_step(engine, rank, step))
    optimizer.synchronize()
    continued, steps_before_load = flat(engine.module), engine.gradsync.sync_steps
    engine.load_checkpoint(str(directory), tag="mid")
    restored_steps = engine.gradsync.sync_steps
    for step in range(saved_at, saved_at + replay):
        micro_step(engine, rank, step)
    optimizer.synchronize()
    replayed = flat(engine.module)
    for step in range(saved_at + replay, steps):
        losses.append(micro_step(engine, rank, step))
    optimizer.synchronize()
    checksums = [None] * dist.get_world_size()
    dist.all_gather_object(checksums, flat(engine.module).double().sum().item())
    averaged_losses = torch.tensor(losses)
    dist.all_reduce(averaged_losses)
    if stage == 0:  # the optimizer's state, gradsync's with it, in the model's file; under ZeRO in each rank's
        saved = torch.load(directory / "mid" / "mp_rank_00_model_states.pt", map_location="cpu",
                           weights_only=False)["optimizer"]["gradsync"]
    else:
        saved = torch.load(directory / "mid" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", map_location="cpu",
                           weights_only=False)["optimizer_state_dict"]["gradsync"]
    result = {"losses": (averaged_losses / dist.get_world_size()).tolist(),
              "replay_max_abs_difference": (continued - replayed).abs().max().item(),
              "steps_before_load": steps_before_load,
              "restored_sync_steps": restored_steps,
              "checkpoint_gradsync": {k: v for k, v in saved.items() if k in ("codec", "step", "world_size")},
              "checkpoint_per_rank_entries": len(saved["per_rank"] or []),
              "replica_checksums": checksums, "codec": engine.gradsync.codec.name,
              "optimizer": type(engine.optimizer).__name__,
              "host_memory_releases": len(HOST_MEMORY_RELEASES) - releases_before}
    engine.destroy()
    return result


def skipped_step_against_plain_deepspeed(rank: int, cost_path: str) -> dict:
    """A step skipped for a NaN gradient must leave the weights and the LR schedule where plain
    DeepSpeed has them without that batch, and count as skipped, as an fp16 overflow does."""
    steps, skipped = 6, 2
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 0.0, "optimizer": SGD,
              "scheduler": WARMUP, **QUIET}
    model = mlp()
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(),
        config={**config, "gradsync": {"scheduler": "wfbp", "cost": cost_path, "nonfinite": "skip"}})
    for step in range(steps):
        x, y = batch(rank, step)
        if step == skipped and rank == 1:
            x[0, 0] = float("nan")
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        if step == skipped:
            applied_when_skipped = engine.was_step_applied()
    optimizer.synchronize()
    model = mlp()
    plain, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(steps):
        if step != skipped:
            micro_step(plain, rank, step)
    result = {"applied_when_skipped": applied_when_skipped, "skipped_steps": engine.skipped_steps,
              "global_steps": (engine.global_steps, plain.global_steps), "lr": (engine.get_lr(), plain.get_lr()),
              "max_abs_difference_to_plain": (flat(engine.module) - flat(plain.module)).abs().max().item()}
    engine.destroy()
    plain.destroy()
    return result


def nan_under_zero_against_deepspeed(rank: int, cost_path: str) -> dict:
    """A NaN in one micro-batch under ZeRO stage 2 in fp32, the section's defaults: DeepSpeed's ZeRO
    optimizer skips that step, with gradsync as without it."""
    reference, plain = trained(zero_config(2, "fp32"), rank, nan_at=4)
    ours, info = trained(zero_config(2, "fp32", {"scheduler": "wfbp", "cost": cost_path}), rank, nan_at=4)
    return {"skipped_steps": (info["skipped_steps"], plain["skipped_steps"]), "finite": info["finite"],
            "max_abs_difference": (ours - reference).abs().max().item()}


def coalesced_against_marked_boundaries(rank: int, cost_path: str) -> dict:
    """Steps of two backward passes under ZeRO stage 2: DeepSpeed's own run reducing them once with
    ``coalesce_grad_reduction()``; gradsync's refusal of that context, and its run marking the
    boundary before each backward pass instead, as the refusal says."""
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 0.0, "optimizer": SGD,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, **QUIET}

    def loss(engine, micro: int) -> torch.Tensor:
        x, y = batch(rank, micro)
        return nn.functional.mse_loss(engine(x), y)

    model = mlp()
    plain, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    model = mlp()
    ours, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                         config={**config, "gradsync": {"scheduler": "wfbp", "cost": cost_path}})
    try:
        with ours.coalesce_grad_reduction():
            refusal = None
    except NotImplementedError as error:
        refusal = str(error)
    for step in range(4):
        with plain.coalesce_grad_reduction():
            for micro in (2 * step, 2 * step + 1):
                plain.backward(loss(plain, micro))
        plain.step()
        for micro in (2 * step, 2 * step + 1):
            ours.set_gradient_accumulation_boundary(micro % 2 == 1)
            ours.backward(loss(ours, micro))
        ours.step()
    result = {"refusal": refusal, "max_abs_difference": (flat(ours.module) - flat(plain.module)).abs().max().item()}
    plain.destroy()
    ours.destroy()
    return result


FP16_RUNS = {"fp16": 2, "fp16_stage0": 0}  # result key -> ZeRO stage
SCHEDULERS = ("wfbp", "ddp", "mg_wfbp", "optimal_merge", "asc_wfbp", "bytescheduler", "us_byte", "auto")


def zero_config(stage: int, precision: str, section: dict | None = None) -> dict:
    """SGD with momentum, accumulation 2 and clipping at 0.5 under ZeRO `stage` in `precision`."""
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.5, "optimizer": SGD, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, **QUIET}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":  # under ZeRO 2^20 overflows the first steps: the scaler skips them and lowers
        # the scale. At stage 0 DeepSpeed's engine does not scale the loss for its fp16 optimizer (which
        # unscales the gradients all the same): the scale starts at 1 there, and a batch overflows instead
        config["fp16"] = {"enabled": True, "initial_scale_power": 20 if stage else 0, "loss_scale_window": 4}
    return config if section is None else {**config, "gradsync": section}


def trained(config: dict, rank: int, steps: int = 10, overflow_at: int | None = None,
            nan_at: int | None = None) -> tuple[torch.Tensor, dict]:
    """The parameters (fp32) after `steps` optimizer steps of plain deepspeed.initialize on `config`;
    the last rank's micro-batch `overflow_at`, if given, beyond fp16's range (rank 1 of the CPU's two
    ranks; the one rank of the CUDA run), and its micro-batch `nan_at` holding a NaN."""
    model = mlp()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    accumulation = config["gradient_accumulation_steps"]
    scales = [getattr(engine.optimizer, "loss_scale", None)]
    rescaled = record_error_rescales(engine) if "gradsync" in config and "fp16" in config else []
    for micro in range(steps * accumulation):
        x, y = (tensor.to(engine.device) for tensor in batch(rank, micro))
        if micro == overflow_at and rank == dist.get_world_size() - 1:
            x = x * 1e6
        if micro == nan_at and rank == dist.get_world_size() - 1:
            x[0, 0] = float("nan")
        dtype = torch.bfloat16 if "bf16" in config else torch.float16 if "fp16" in config else torch.float32
        engine.backward(nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
        engine.step()
        if scales[-1] != getattr(engine.optimizer, "loss_scale", None):
            scales.append(engine.optimizer.loss_scale)
    parameters = flat(engine.module).float().cpu()
    info = {"optimizer": type(engine.optimizer).__name__, "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps, "loss_scale": getattr(engine.optimizer, "loss_scale", None),
            "finite": bool(parameters.isfinite().all()), "scale_changes": [b / a for a, b in zip(scales, scales[1:])],
            "errors_rescaled": rescaled}
    if "gradsync" in config:
        info["collectives"] = sorted({op.collective for op in engine.gradsync.plan.ops})
        info["compressor_steps"] = engine.gradsync.sync_steps
    engine.destroy()
    return parameters, info


def record_error_rescales(engine) -> list[float]:
    """The factors gradsync's error feedback is rescaled by (its runtime's loss_scale_changed), as
    a list that fills while the engine trains."""
    factors, sync = [], engine.optimizer.gradsync.sync
    rescale = sync.loss_scale_changed

    def recorded(factor: float) -> None:
        factors.append(factor)
        rescale(factor)

    sync.loss_scale_changed = recorded
    return factors


def bf16_ulps(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest difference in units of the last place of bf16 (8 significant bits) at the
    magnitude of the largest parameter."""
    largest = torch.maximum(ours.abs(), theirs.abs()).max()
    return ((ours - theirs).abs().max() / torch.exp2(torch.floor(torch.log2(largest)) - 7)).item()


def stages_against_deepspeed(rank: int, cost_path: str) -> dict:
    """Per stage, precision and scheduler: gradsync's parameters beside DeepSpeed's own run."""
    results = {}
    for stage, precision, schedulers in ((0, "fp32", SCHEDULERS), (0, "bf16", SCHEDULERS), (1, "bf16", SCHEDULERS),
                                         (2, "bf16", SCHEDULERS), (1, "fp32", ("us_byte",)), (2, "fp32", ("mg_wfbp",))):
        reference, plain = trained(zero_config(stage, precision), rank)
        for scheduler in schedulers:
            releases_before = len(HOST_MEMORY_RELEASES)
            ours, info = trained(zero_config(stage, precision, {"scheduler": scheduler, "cost": cost_path}), rank)
            sums = [None] * dist.get_world_size()
            dist.all_gather_object(sums, ours.double().sum().item())
            results[f"{stage} {precision} {scheduler}"] = {
                **info, "deepspeed_optimizer": plain["optimizer"], "replicas_equal": len(set(sums)) == 1,
                "max_abs_difference": (ours - reference).abs().max().item(), "bf16_ulps": bf16_ulps(ours, reference),
                "host_memory_releases": len(HOST_MEMORY_RELEASES) - releases_before}
    return results


def fp16_against_deepspeed(rank: int, cost_path: str, stage: int) -> dict:
    """fp16 under ZeRO `stage` (2: ZeRO's optimizer, the first steps overflowing; 0: DeepSpeed's fp16
    optimizer, one batch overflowing): gradsync uncompressed and with acp_sgd, beside DeepSpeed's
    own run. The CPU accelerator declares no fp16 support though its kernels compute in fp16: the
    job lifts that flag (the same runs on CUDA are in the GPU acceptance run)."""
    if get_accelerator().device_name() == "cpu":
        get_accelerator().is_fp16_supported = lambda: True
    overflow_at = None if stage else 4  # the third step's first micro-batch (see zero_config)
    reference, plain = trained(zero_config(stage, "fp16"), rank, overflow_at=overflow_at)
    results = {"deepspeed": plain}
    for name, section in (("us_byte", {"scheduler": "us_byte"}),
                          ("acp_sgd", {"scheduler": "wfbp", "compressor": {"type": "acp_sgd", "rank": 2}})):
        ours, info = trained(zero_config(stage, "fp16", {**section, "cost": cost_path}), rank, overflow_at=overflow_at)
        sums = [None] * dist.get_world_size()
        dist.all_gather_object(sums, ours.double().sum().item())
        results[name] = {**info, "replicas_equal": len(set(sums)) == 1,
                         "max_abs_difference": (ours - reference).abs().max().item()}
    return results


class EveryOtherHead(nn.Module):
    """mlp, plus a head added to its output on every other forward pass: on the others no rank
    gives the head a gradient."""

    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.head = nn.Linear(FEATURES, OUTPUTS)
        self.passes = 0

    def forward(self, x):
        self.passes += 1
        return self.body(x) + self.head(x) if self.passes % 2 else self.body(x)


def unused_layer_against_deepspeed(rank: int, cost_path: str) -> dict:
    """8 steps of EveryOtherHead (7); per scheduler, the largest difference to DeepSpeed's own run,
    whose all-reduce gives the head zeros on its idle steps, which momentum and weight decay act on."""
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 0.0, **QUIET,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}}}

    def run(section: dict | None) -> torch.Tensor:
        model = EveryOtherHead()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config if section is None else {**config, "gradsync": section})
        for step in range(8):
            micro_step(engine, rank, step)
        # the state dict applies the updates deferred to the next forward first
        trained = torch.cat([tensor.reshape(-1) for tensor in engine.module.state_dict().values()])
        engine.destroy()
        return trained

    reference = run(None)
    return {scheduler: (run({"scheduler": scheduler, "cost": cost_path}) - reference).abs().max().item()
            for scheduler in ("wfbp", "us_byte")}


def unfrozen_layer_against_deepspeed(rank: int, cost_path: str) -> dict:
    """mlp's first layer frozen at ``deepspeed.initialize`` (the optimizer holding every parameter),
    two steps, then unfrozen for four, at stage 0 in fp32; per scheduler, the largest difference to
    DeepSpeed's own run, whose all-reduce takes the layer in, and how far the layer moved there."""
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 0.0, **QUIET,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}

    def run(section: dict | None) -> torch.Tensor:
        model = mlp()
        model[0].requires_grad_(False)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config if section is None else {**config, "gradsync": section})
        for step in range(6):
            if step == 2:
                model[0].requires_grad_(True)
            micro_step(engine, rank, step)
        trained = flat(engine.module)  # (parameters() applies the updates deferred to the next forward first)
        engine.destroy()
        return trained

    reference = run(None)
    first_layer = FEATURES * 32 + 32
    result = {scheduler: (run({"scheduler": scheduler, "cost": cost_path}) - reference).abs().max().item()
              for scheduler in ("wfbp", "us_byte")}
    return {**result, "moved": (reference[:first_layer] - flat(mlp())[:first_layer]).abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--cuda", action="store_true", help="on CUDA (NCCL): the mixed-precision ZeRO runs alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    random.seed(0)  # rank 0 draws the low-rank codecs' seed: every run of the job alike
    set_log_level_from_string("info")  # the plan gradsync runs is an INFO line of DeepSpeed's logger
    if not args.cuda:
        without_shared_memory_op()
    deepspeed.init_distributed(dist_backend="nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    cost_path = args.out / "cost.json"
    if rank == 0:
        cost_path.write_text(json.dumps({"a": 1e-3, "b": 1e-8, "gamma": 1.0}))
    dist.barrier()
    started = time.perf_counter()
    result = {"world_size": dist.get_world_size(), "backend": dist.get_backend(),
              "accelerator": get_accelerator().device_name()}
    if args.cuda:
        torch.cuda.set_device(args.local_rank)
        result.update({key: fp16_against_deepspeed(rank, str(cost_path), stage) for key, stage in FP16_RUNS.items()})
    else:
        result.update(cpu_runs(rank, cost_path, args.out))
    result["seconds"] = time.perf_counter() - started
    if rank == 0:
        (args.out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


def without_shared_memory_op() -> None:
    """DeepSpeed's CPU backend builds its shared-memory op as it starts (a compile of about half a
    minute in a fresh environment) for ``inference_all_reduce`` alone, which training never calls.
    The backend starts without it, as on a platform where the op cannot be built: every collective
    is torch's."""
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def cpu_runs(rank: int, cost_path: Path, out: Path) -> dict:
    """Every run of the module docstring, on 2 CPU ranks (gloo)."""
    cost = str(cost_path)
    return {"uncompressed": uncompressed_equivalence(rank, cost, 0.0, {}, out / "monitor"),
            "uncompressed_clipped": uncompressed_equivalence(rank, cost, 1.0,
                                                             {"transport": "forest", "topology": "complete-2"}),
            "acp_sgd": compressed_with_checkpoint(rank, out / "checkpoint"),
            **{f"acp_sgd_zero{stage}": compressed_with_checkpoint(rank, out / f"checkpoint{stage}", stage, "fp32", cost)
               for stage in (1, 2)},
            "acp_sgd_bf16": compressed_with_checkpoint(rank, out / "checkpoint_bf16", 0, "bf16", cost),
            "skip": skipped_step_against_plain_deepspeed(rank, cost),
            "stages": stages_against_deepspeed(rank, cost),
            "nan_zero2": nan_under_zero_against_deepspeed(rank, cost),
            "coalesced": coalesced_against_marked_boundaries(rank, cost),
            **{key: fp16_against_deepspeed(rank, cost, stage) for key, stage in FP16_RUNS.items()},
            "unused_layer": unused_layer_against_deepspeed(rank, cost),
            "unfrozen_layer": unfrozen_layer_against_deepspeed(rank, cost)}


if __name__ == "__main__":
    main()

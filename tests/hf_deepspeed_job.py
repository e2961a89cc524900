"""Hugging Face's routes into DeepSpeed, each run with and without a "gradsync" section in the
config: Transformers' Trainer (``TrainingArguments(deepspeed=config)``) and Accelerate
(``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))``); and gradsync's
compression hook on the model Accelerate prepares without DeepSpeed. Each rank is its own
process, as under torchrun: `python hf_deepspeed_job.py OUT` with RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set; rank 0 writes, per run, the engine that trained and how far
gradsync's trained parameters lie from DeepSpeed's own to OUT/result.json.

Accelerate runs DeepSpeed on accelerators alone: on CPU it finds no backend and counts a world of
one. The job lifts that one check (Accelerate then starts DeepSpeed's backend on gloo, as it starts
it on nccl on GPUs), and DeepSpeed's CPU backend starts without its shared-memory op, as in
tests/deepspeed_job.py; the rest is theirs.
"""
import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType
from torch import nn
from transformers import Trainer, TrainingArguments

import gradsync  # noqa: F401  (its entry in DeepSpeed's engine)
from gradsync.comm_hooks import CompressionState, compression_hook

FEATURES, OUTPUTS, STEPS = 8, 4, 12
SECTION = {"scheduler": "us_byte", "cost": {"a": 1e-3, "b": 1e-8, "gamma": 1.0}}
COMPRESSED = {**SECTION, "compressor": {"type": "acp_sgd", "rank": 2}}
# run: (route, ZeRO stage, gradient accumulation steps, clipping norm)
RUNS = {"trainer_zero0": ("trainer", 0, 2, 2.0), "trainer_zero2": ("trainer", 2, 2, 0.0),
        "accelerate_zero1": ("accelerate", 1, 1, 0.0), "trainer_zero1": ("trainer", 1, 1, 0.0)}
# the runs compared with DeepSpeed's own run of the config without the section
BESIDE_DEEPSPEED = ("trainer_zero0", "trainer_zero2", "accelerate_zero1")


class Regression(nn.Module):
    """A small MLP whose forward takes a batch's fields and returns the loss, as Transformers'
    models do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                                  nn.Linear(32, OUTPUTS))

    def forward(self, x, y):
        out = self.body(x)
        return {"loss": nn.functional.mse_loss(out, y), "logits": out}


def examples(count: int, seed: int) -> list[dict]:
    truth = torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(7))
    inputs = torch.randn(count, FEATURES, generator=torch.Generator().manual_seed(seed))
    return [{"x": x, "y": x @ truth} for x in inputs]


def deepspeed_config(stage: int, section: dict | None) -> dict:
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    return config if section is None else {**config, "gradsync": section}


def trained_by_trainer(stage: int, accumulation: int, clipping: float, section: dict | None, out: Path,
                       resumed: bool = False):
    """Transformers' Trainer for STEPS optimizer steps (its SGD, a constant rate): the engine and
    the trained state as Accelerate gathers it to save the model. Where `resumed`, a first Trainer
    stops halfway and saves a checkpoint, and a second one resumes from it."""
    def trainer(steps: int) -> Trainer:
        arguments = TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=8, max_steps=steps, optim="sgd", learning_rate=0.05,
            lr_scheduler_type="constant", max_grad_norm=clipping, gradient_accumulation_steps=accumulation,
            deepspeed=deepspeed_config(stage, section), report_to=[], save_strategy="steps", save_steps=STEPS // 2,
            logging_steps=10**6, disable_tqdm=True, seed=0)
        return Trainer(model=Regression(), args=arguments, train_dataset=examples(512, seed=3))

    if resumed:
        first = trainer(STEPS // 2)
        first.train()
        first.model_wrapped.destroy()
        AcceleratorState._reset_state()
    last = trainer(STEPS)
    last.train(resume_from_checkpoint=str(out / f"checkpoint-{STEPS // 2}") if resumed else None)
    return last.model_wrapped, last.accelerator.get_state_dict(last.model_wrapped)


def accelerate_loop(accelerator: Accelerator, model: nn.Module, optimizer) -> None:
    """Accelerate's loop (`accelerator.backward`, then the optimizer's step and zero_grad) for STEPS
    steps, each rank its own batches."""
    batches = examples(8 * STEPS, seed=100 + dist.get_rank())
    for step in range(STEPS):
        batch = batches[8 * step: 8 * (step + 1)]
        loss = model(torch.stack([e["x"] for e in batch]), torch.stack([e["y"] for e in batch]))["loss"]
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def trained_by_accelerate(stage: int, accumulation: int, clipping: float, section: dict | None, out: Path):
    """Accelerate's loop over DeepSpeed's engine, SGD with momentum."""
    config = {**deepspeed_config(stage, section), "train_micro_batch_size_per_gpu": 8,
              "gradient_accumulation_steps": accumulation, "gradient_clipping": clipping}
    config["train_batch_size"] = 8 * accumulation * dist.get_world_size()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = Regression()
    engine, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    accelerate_loop(accelerator, engine, optimizer)
    return engine, accelerator.get_state_dict(engine)


def hooked_by_accelerate(compressor: str | None) -> torch.Tensor:
    """Accelerate's loop over its DistributedDataParallel (no DeepSpeed), SGD with momentum, with
    gradsync's compression hook registered on the prepared model (`compressor` None: DDP's own
    all-reduce): the trained parameters, flat."""
    accelerator = Accelerator(cpu=True)
    model = Regression()
    ddp_model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    if compressor is not None:
        ddp_model.register_comm_hook(CompressionState(model, compressor), compression_hook)
    accelerate_loop(accelerator, ddp_model, optimizer)
    AcceleratorState._reset_state()
    return torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])


ROUTES = {"trainer": trained_by_trainer, "accelerate": trained_by_accelerate}


def initial_parameters() -> torch.Tensor:
    """The parameters every run starts from, flat."""
    return torch.cat([tensor.reshape(-1) for tensor in Regression().state_dict().values()])


def run(name: str, section: dict | None, out: Path, **options) -> tuple[list, torch.Tensor]:
    """The engine's class and whether it all-reduces the gradients itself, and the trained
    parameters, flat, after `name` of RUNS (the route's `options`)."""
    route, stage, accumulation, clipping = RUNS[name]
    engine, state = ROUTES[route](stage, accumulation, clipping, section, out / name, **options)
    trained = torch.cat([tensor.detach().float().reshape(-1) for tensor in state.values()])
    ran = [type(engine).__name__, engine.enable_backward_allreduce]
    engine.destroy()
    AcceleratorState._reset_state()  # the next run's Accelerator takes its own DeepSpeed plugin
    return ran, trained


def same_on_every_rank(parameters: torch.Tensor) -> bool:
    """Whether every rank holds these trained parameters (their sums compared)."""
    sums = [None] * dist.get_world_size()
    dist.all_gather_object(sums, parameters.double().sum().item())
    return len(set(sums)) == 1


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    PartialState._prepare_backend = lambda self, cpu, sagemaker_dp, backend: ("gloo", DistributedType.MULTI_CPU)
    # first, while Accelerate has not been told of DeepSpeed (its plugin sets that for the process)
    ddp, identity, acp_sgd = (hooked_by_accelerate(compressor) for compressor in (None, "identity", "acp_sgd"))
    result = {"accelerate_ddp_hook": {"identity_difference_to_ddp": (identity - ddp).abs().max().item(),
                                      "acp_sgd_difference_to_ddp": (acp_sgd - ddp).abs().max().item(),
                                      "acp_sgd_replicas_agree": same_on_every_rank(acp_sgd)}}
    for name in BESIDE_DEEPSPEED:
        plain_engine, plain = run(name, None, out)
        engine, trained = run(name, SECTION, out)
        result[name] = {"engines": [plain_engine, engine], "world_size": dist.get_world_size(),
                        "replicas_agree": same_on_every_rank(trained),
                        "trained_from_start": (plain - initial_parameters()).abs().max().item(),
                        "max_abs_difference_to_plain": (trained - plain).abs().max().item()}
    # ACP-SGD's error feedback and factors travel in the Trainer's checkpoint
    _, straight = run("trainer_zero1", COMPRESSED, out / "straight")
    _, resumed = run("trainer_zero1", COMPRESSED, out / "resumed", resumed=True)
    result["trainer_zero1_acp_sgd_resumed"] = {"max_abs_difference_to_straight":
                                               (resumed - straight).abs().max().item()}
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

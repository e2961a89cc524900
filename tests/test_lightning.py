"""gradsync's Lightning strategies on 2 CPU ranks (gloo), against Lightning's own `ddp` strategy.

Most runs share one launch: `gradsync.launch.run_local` starts the ranks and each builds several
Trainers in turn (Lightning sees externally created processes, as under torchrun). Two more tests
use Lightning's own launchers: spawn (`start_method="spawn"`), and the default one that re-runs
this file as a script (`python tests/test_lightning.py DIR`, the user path of
`Trainer(strategy="acp_sgd")` with `import gradsync` as the only registration).
"""
import csv
import json
import math
import os
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("pytorch_lightning")

from gradsync import ConfigError  # noqa: E402
from gradsync.cost import CostModel  # noqa: E402
from gradsync.launch import run_local  # noqa: E402
from gradsync.recipes.models import build  # noqa: E402
from gradsync.strategies import GradSyncStrategy, strategy_entries  # noqa: E402
from pytorch_lightning.callbacks import (BackboneFinetuning, EMAWeightAveraging, ModelCheckpoint,  # noqa: E402
                                         StochasticWeightAveraging)
from pytorch_lightning.loggers import CSVLogger  # noqa: E402
from pytorch_lightning.plugins.precision import MixedPrecision  # noqa: E402
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry  # noqa: E402

STEPS = 6
# the built-in strategy names (the registries' entries, written out so that a change shows)
SCHEDULERS = ("wfbp", "ddp_buckets", "mg_wfbp", "optimal_merge", "asc_wfbp", "bytescheduler", "us_byte",
              "gradsync_auto")
COMPRESSORS = ("acp_sgd", "powersgd", "signsgd", "topk", "fp16", "bf16", "minmax8")
NAMES = (*SCHEDULERS, *COMPRESSORS, "forest")
TOLERANCE = 1e-5
CLIP = 0.05
# fp16 overflows at this initial loss scale: the GradScaler skips the first steps, then halves it
FP16_INITIAL_SCALE = 2.0**22
STATS = ("iteration_time", "predicted_time", "comm_wait", "codec_time", "bytes_sent", "compression_ratio")

# the model: Linear(16→32), Linear(32→32), Linear(32→4) and their biases
GRADIENT_NUMEL = 32 * 16 + 32 + 32 * 32 + 32 + 4 * 32 + 4
# ACP-SGD at rank 4 compresses an n×m weight when (n + m)·4·2 < n·m: the first two weights only.
# A P step sends their P factors (n×4), a Q step their Q factors (m×4), the rest whole.
ACP_P_NUMEL = 32 * 4 + 32 + 32 * 4 + 32 + 4 * 32 + 4
ACP_Q_NUMEL = 16 * 4 + 32 + 32 * 4 + 32 + 4 * 32 + 4
# every op's buffer ends with one "used" flag per tensor it carries and one "non-finite" flag
# (runtime/executor.py): six tensors in unpartitioned plans, plus one per op
USED_FLAGS = 6


class Classifier(pl.LightningModule):
    """training_step calls the inner network, not self(...): gradsync's root hook must still run."""

    def __init__(self):
        super().__init__()
        self.net = build("mlp", inputs=16, classes=4, hidden=32)

    def training_step(self, batch, _index):
        inputs, targets = batch
        loss = F.cross_entropy(self.net(inputs), targets)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class BatchNormClassifier(Classifier):
    """Buffers that differ per rank (batch statistics) and a validation loop: DDP broadcasts rank
    0's buffers at every forward, so validation sees the same buffers on every rank."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 4))

    def validation_step(self, batch, _index):
        inputs, targets = batch
        self.log("val_loss", F.cross_entropy(self.net(inputs), targets))

    def val_dataloader(self):
        return batches()


class ManualClassifier(Classifier):
    """Manual optimisation: the step runs inside training_step, through Lightning's optimizer,
    after the model clips the gradients itself."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, _index):
        optimizer = self.optimizers()
        inputs, targets = batch
        optimizer.zero_grad()
        self.manual_backward(F.cross_entropy(self.net(inputs), targets))
        self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        optimizer.step()


class GANModule(pl.LightningModule):
    """Two optimizers under manual optimisation: a GAN's alternating steps, the discriminator's
    then the generator's, the discriminator frozen for the generator's by toggle_optimizer."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 16))
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch, _index):
        g_optimizer, d_optimizer = self.optimizers()
        real, _ = batch
        fake = self.generator(real[:, :4])
        d_optimizer.zero_grad()
        self.manual_backward(F.softplus(-self.discriminator(real)).mean()
                             + F.softplus(self.discriminator(fake.detach())).mean())
        d_optimizer.step()
        self.toggle_optimizer(g_optimizer)
        g_optimizer.zero_grad()
        self.manual_backward(F.softplus(-self.discriminator(fake)).mean())
        g_optimizer.step()
        self.untoggle_optimizer(g_optimizer)

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-2),
                torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9))


class HookClipClassifier(Classifier):
    """Clips in its own configure_gradient_clipping, without the Trainer's gradient_clip_val."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")


class GradientNorms(pl.Callback):
    """Records the gradient norm a hook sees at each step."""

    def __init__(self):
        self.norms: list[float] = []

    def record(self, pl_module) -> None:
        self.norms.append(torch.stack([p.grad.norm() for p in pl_module.parameters()]).norm().item())


class NormsBeforeStep(GradientNorms):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.record(pl_module)


class NormsAfterBackward(GradientNorms):
    """on_after_backward runs before the strategy's post_backward."""

    def on_after_backward(self, trainer, pl_module):
        self.record(pl_module)


class BackboneClassifier(Classifier):
    """A backbone and a head, for Lightning's BackboneFinetuning: the callback freezes the backbone
    before the strategy attaches, and unfreezes it at an epoch's start (adding its parameter group)."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
        self.net = torch.nn.Sequential(self.backbone, torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1, momentum=0.9)


def batches(batch_size: int = 8, rank: int | None = None):
    """96 fixed samples, 8 per batch, in order (Lightning's DistributedSampler gives each rank 48); or
    `rank`'s half alone, the `rank`-th of each pair, in order: one device's batches of 16 are then
    the two ranks' batches together."""
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(96, 16, generator=generator),
                                          torch.randint(0, 4, (96,), generator=generator))
    if rank is not None:
        data = torch.utils.data.Subset(data, range(rank, 96, 2))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def trainer_for(strategy, root, **options):
    settings = dict(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                    log_every_n_steps=1)
    return pl.Trainer(strategy=strategy, **{**settings, **options})


def flat(model) -> list[float]:
    """Parameters and buffers, in state_dict order."""
    return torch.cat([t.detach().double().reshape(-1) for t in model.state_dict().values()]).tolist()


class PlanOps(pl.Callback):
    """Records, before each batch, the codec layout and the op count of the plan its backward pass
    runs (none without gradsync). The runtime replaces its plans once it has timed the layers, so
    the count is taken per step."""

    def __init__(self):
        self.ops: list[list] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is not None:
            self.ops.append([runtime.codec.rounds(runtime.sync_steps)[0], len(runtime.plan.ops)])


# a given cost model: no network probes at wrap (0.1 s a fit instead of 1.6 s here), for the runs
# that check Lightning's features rather than the registered names' own defaults
GIVEN_COST = CostModel(1e-4, 1e-9)


PROBED = ("acp_sgd", "gradsync_auto")  # trained by their registered names, cost probes and all


def without_probes(name: str):
    """The strategy registered as `name` with GIVEN_COST (Lightning's own for ``ddp``)."""
    return name if name == "ddp" else GradSyncStrategy(**StrategyRegistry[name]["init_params"], cost=GIVEN_COST)


def fit(strategy, root, ckpt_path=None, model_class=Classifier, data=None, **options) -> dict:
    """Train a freshly seeded model; its final parameters and buffers, the metrics and the plans'
    op counts. Python's generator is seeded too: rank 0 draws the compressors' seed from it."""
    pl.seed_everything(0, verbose=False)
    model = model_class()
    plan_ops = PlanOps()
    options["callbacks"] = [plan_ops, *options.get("callbacks", [])]
    trainer = trainer_for(strategy, root, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data or batches(), ckpt_path=ckpt_path)
    return {"params": flat(model), "progress_bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}, "ops": plan_ops.ops,
            "no_logger_warnings": [str(w.message) for w in caught if "but have no logger configured" in str(w.message)]}


def fp16_with_grad_scaler():
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=FP16_INITIAL_SCALE))


class LossScaleSeen(pl.Callback):
    """Records, before each optimizer step, the GradScaler's scale and the one gradsync read for the
    compressor's error feedback at the step's start (from `follower(trainer)`, a LossScaleFollower)."""

    def __init__(self, follower):
        self.follower, self.scales = follower, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        follower = self.follower(trainer)
        self.scales.append((trainer.strategy.precision_plugin.scaler.get_scale(), follower and follower.seen))


def fit_following_the_scale(root) -> dict:
    """acp_sgd under fp16 AMP: the scales the runtime read, beside the GradScaler's."""
    seen = LossScaleSeen(lambda trainer: trainer.strategy.runtime.loss_scale)
    return {**fit(without_probes("acp_sgd"), root, plugins=[fp16_with_grad_scaler()], callbacks=[seen]),
            "scales": seen.scales}


def fit_recording_norms(strategy, root, recorder=NormsBeforeStep) -> dict:
    norms = recorder()
    return {**fit(strategy, root, callbacks=[norms]), "norms": norms.norms}


def initial() -> dict:
    torch.manual_seed(0)
    return {"params": flat(Classifier())}


def attempt(run) -> dict:
    """`run()`, or the error it raised (a ConfigError from wrap comes on every rank, before any
    collective, so the ranks go on to the next run together)."""
    try:
        return run()
    except Exception as exc:  # reported by the test of that run
        return {"error": f"{type(exc).__name__}: {exc}"}


def save_without_gradsync_state(path: Path, stripped: Path) -> None:
    """Write a copy of a checkpoint whose optimizer state lacks gradsync's entry (codec state, step)."""
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["optimizer_states"][0].pop("gradsync")
    torch.save(checkpoint, stripped)


def straight_and_resumed(train, checkpoints: Path) -> dict:
    """`train(**trainer_options)` for two 3-step epochs straight, and one epoch + a checkpoint (in
    `checkpoints`, which every rank reads) + a resumed second."""
    epoch = dict(limit_train_batches=3, max_steps=-1)
    runs = {"straight": attempt(lambda: train(max_epochs=2, **epoch))}
    saver = ModelCheckpoint(dirpath=checkpoints, filename="resume", save_on_train_epoch_end=True)
    runs["first_epoch"] = attempt(lambda: train(callbacks=[saver], max_epochs=1, enable_checkpointing=True, **epoch))
    runs["resumed"] = attempt(lambda: train(ckpt_path=checkpoints / "resume.ckpt", max_epochs=2, **epoch))
    return runs


def resume_runs(rank, root: Path) -> dict:
    """acp_sgd straight and resumed (straight_and_resumed), and resumed from the checkpoint stripped
    of gradsync's state."""
    epoch = dict(limit_train_batches=3, max_steps=-1)
    runs = straight_and_resumed(lambda **options: fit(without_probes("acp_sgd"), root, **options), root / "checkpoints")
    saved = root / "checkpoints" / "resume.ckpt"
    stripped = saved.with_name("stripped.ckpt")
    if rank == 0:
        save_without_gradsync_state(saved, stripped)
        gradsync_state = torch.load(saved, weights_only=False)["optimizer_states"][0]["gradsync"]
        runs["saved"] = {"step": gradsync_state["step"], "error_feedback_ranks": len(gradsync_state["per_rank"])}
    torch.distributed.barrier()
    runs["resumed_without_gradsync_state"] = attempt(
        lambda: fit(without_probes("acp_sgd"), root, ckpt_path=stripped, max_epochs=2, **epoch))
    return runs


def fit_averaging_weights(strategy, root) -> dict:
    """Three 3-step epochs under Lightning's StochasticWeightAveraging from the second on: it reads
    the parameters at each epoch's start and copies its average into the model at the training's end."""
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    return fit(strategy, root, callbacks=[swa], max_epochs=3, max_steps=-1, limit_train_batches=3)


def deferred_us_byte() -> GradSyncStrategy:
    """us_byte with its updates deferred to each layer's next forward from the first iteration on."""
    return GradSyncStrategy(scheduler="us_byte", cost=GIVEN_COST, overlap_forward=True, partition_bytes=512,
                            warmup_iterations=0, measure_iterations=1)


def fit_backbone_finetuning(strategy, root, data, **options) -> dict:
    """Three epochs of 6 steps over `data` as it is (no sampler of Lightning's), the backbone
    unfrozen by BackboneFinetuning at the second."""
    return fit(strategy, root, model_class=BackboneClassifier, data=data, max_steps=-1, max_epochs=3,
               use_distributed_sampler=False, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
               **options)


def fit_with_hook_callback(root, ckpt_path=None, callbacks=(), **options) -> dict:
    """Lightning's own `ddp` with gradsync's communication hook registered by the CompressionHook
    callback (on the CPU too), acp_sgd: the parameters and the steps the hook synchronised; under
    a GradScaler, the scales the hook read for the error feedback beside the scaler's."""
    from gradsync.comm_hooks import CompressionState
    from gradsync.strategies import CompressionHook

    pl.seed_everything(0, verbose=False)
    model = Classifier()
    state = CompressionState(model, {"type": "acp_sgd", "rank": 2})
    seen = LossScaleSeen(lambda trainer: state._loss_scale)
    scaled = any(isinstance(plugin, MixedPrecision) for plugin in options.get("plugins", ()))
    trainer = trainer_for("ddp", root, callbacks=[CompressionHook(state), *callbacks, *([seen] if scaled else [])],
                          **options)
    trainer.fit(model, batches(), ckpt_path=ckpt_path)
    return {"params": flat(model), "hook_steps": state.step, "scales": seen.scales}


def hook_resume_runs(root: Path) -> dict:
    """The hook callback straight and resumed (the hook's state, every rank's, in Lightning's
    checkpoint)."""
    return straight_and_resumed(lambda **options: fit_with_hook_callback(root, **options), root / "hook_checkpoints")


def all_runs(rank, world_size, root):
    """Every scenario on this rank, in one launch (Trainer start-up is cheap, process start-up is not)."""
    os.environ["LOCAL_RANK"] = str(rank)  # processes created outside Lightning: no re-launch
    warnings.filterwarnings("ignore")
    shared = Path(root)
    root = shared / f"rank{rank}"
    results = {"ddp": fit("ddp", root)}
    for name in NAMES:
        results[name] = attempt(lambda: fit(name if name in PROBED else without_probes(name), root))
    results["progress_bar/wfbp"] = attempt(lambda: fit(GradSyncStrategy(scheduler="wfbp", progress_bar=True,
                                                                         cost=GIVEN_COST), root))
    for name in ("ddp", "wfbp", "us_byte"):
        results[f"accumulate/{name}"] = attempt(lambda: fit(without_probes(name), root, accumulate_grad_batches=2))
        results[f"clip/{name}"] = attempt(lambda: fit(without_probes(name), root, gradient_clip_val=CLIP))
        results[f"clip_hook/{name}"] = attempt(lambda: fit(without_probes(name), root, model_class=HookClipClassifier))
        results[f"fp16/{name}"] = attempt(lambda: fit(without_probes(name), root, plugins=[fp16_with_grad_scaler()]))
        results[f"batchnorm/{name}"] = attempt(lambda: fit(without_probes(name), root, model_class=BatchNormClassifier,
                                                           val_check_interval=3, limit_val_batches=2))
    for name in ("ddp", "us_byte"):
        results[f"manual/{name}"] = attempt(lambda: fit(without_probes(name), root, model_class=ManualClassifier))
        results[f"norms/{name}"] = attempt(lambda: fit_recording_norms(without_probes(name), root))
        results[f"norms_after_backward/{name}"] = attempt(
            lambda: fit_recording_norms(without_probes(name), root, NormsAfterBackward))
    results["gan/ddp"] = attempt(lambda: fit("ddp_find_unused_parameters_true", root, model_class=GANModule))
    for name in ("wfbp", "us_byte"):
        results[f"gan/{name}"] = attempt(lambda: fit(without_probes(name), root, model_class=GANModule))
    for name in ("wfbp", "us_byte", "gradsync_auto", "acp_sgd"):
        results[f"backbone/{name}"] = attempt(lambda: fit_backbone_finetuning(without_probes(name), root,
                                                                              batches(rank=rank)))
    results["swa/ddp"] = attempt(lambda: fit_averaging_weights("ddp", root))
    results["swa/us_byte"] = attempt(lambda: fit_averaging_weights(deferred_us_byte(), root))
    for name, strategy in (("ddp", "ddp"), ("us_byte", deferred_us_byte())):
        results[f"ema/{name}"] = attempt(lambda: fit(strategy, root, callbacks=[EMAWeightAveraging(decay=0.5)]))
    results["fp16/acp_sgd"] = attempt(lambda: fit_following_the_scale(root))
    results["fp16/hook"] = attempt(lambda: fit_with_hook_callback(root, plugins=[fp16_with_grad_scaler()]))
    results["resume"] = resume_runs(rank, shared)
    results["hook_resume"] = hook_resume_runs(shared)
    results["gan_resume"] = straight_and_resumed(  # both optimizers' states carry gradsync's
        lambda **options: fit(without_probes("acp_sgd"), shared, model_class=GANModule, **options),
        shared / "gan_checkpoints")
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_local(all_runs, 2, str(tmp_path_factory.mktemp("lightning")), timeout=240)


def params(run) -> torch.Tensor:
    assert "error" not in run, run["error"]
    return torch.tensor(run["params"], dtype=torch.float64)


def distance(a, b) -> float:
    return (params(a) - params(b)).abs().max().item()


def backbone_moved(run) -> float:
    """How far a BackboneClassifier run moved its backbone's first weight from the seeded start."""
    torch.manual_seed(0)
    start = BackboneClassifier().backbone[0].weight.detach().double().reshape(-1)
    values, offset = params(run), 0
    for name, tensor in BackboneClassifier().state_dict().items():  # `flat`'s order
        if name == "backbone.0.weight":
            return (values[offset:offset + tensor.numel()] - start).abs().max().item()
        offset += tensor.numel()
    raise KeyError("backbone.0.weight")


# -- registration (no ranks) -------------------------------------------------------------------------
def test_every_name_is_registered_with_its_scheduler_and_compressor():
    for name in SCHEDULERS:
        scheduler = {"ddp_buckets": "ddp", "gradsync_auto": "auto"}.get(name, name)
        assert StrategyRegistry[name]["init_params"] == {"scheduler": scheduler}
    for name in COMPRESSORS:
        assert StrategyRegistry[name]["init_params"] == {"scheduler": "optimal_merge", "compressor": name}
    assert StrategyRegistry["forest"]["init_params"] == {"scheduler": "auto", "transport": "forest"}
    assert set(NAMES) == {*SCHEDULERS, *COMPRESSORS, "forest"} == set(strategy_entries())
    assert all(StrategyRegistry[name]["strategy"] is GradSyncStrategy for name in NAMES)
    assert all(StrategyRegistry[name]["description"] == strategy_entries()[name][1] for name in NAMES)
    assert all(StrategyRegistry[name]["description"].startswith("gradsync: ") for name in NAMES)


def test_registering_again_replaces_without_error():
    GradSyncStrategy.register_strategies(StrategyRegistry)
    assert StrategyRegistry["acp_sgd"]["strategy"] is GradSyncStrategy


def test_registered_name_builds_the_strategy():
    trainer = pl.Trainer(strategy="acp_sgd", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, GradSyncStrategy)
    assert (trainer.strategy.scheduler, trainer.strategy.compressor) == ("optimal_merge", "acp_sgd")


def test_lightning_and_gradsync_options_are_split():
    strategy = GradSyncStrategy("us_byte", start_method="spawn", process_group_backend="cpu:gloo",
                                partition_bytes=4096, measure_iterations=2)
    assert (strategy._start_method, strategy.process_group_backend) == ("spawn", "cpu:gloo")
    assert strategy.gradsync_options == {"partition_bytes": 4096, "measure_iterations": 2}


def test_timeout_is_gradsyncs_and_the_process_groups():
    strategy = GradSyncStrategy("wfbp", timeout=30)
    assert strategy.gradsync_options == {"timeout": 30}
    assert strategy._timeout == timedelta(seconds=30)
    assert GradSyncStrategy("wfbp")._timeout == DDPStrategy()._timeout  # Lightning's default otherwise


def test_gradsync_imports_without_lightning():
    hide_lightning = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pytorch_lightning', 'lightning', 'lightning_fabric'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "import gradsync.strategies\n"
        "print(sorted(gradsync.strategies.__all__))\n")
    done = subprocess.run([sys.executable, "-c", hide_lightning], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["['strategy_entries']"]


@pytest.mark.parametrize("arguments, message", [
    ({"scheduler": "fastest"}, "scheduler.*wfbp"),
    ({"channels": 0}, "'channels'"),
    ({"compressor": {"type": "acp_sgd", "rank": 0}}, "'rank'"),
    ({"scheduler": "us_byte", "partition_bytes": -1}, "partition_bytes"),
    ({"nonfinite": "hope"}, "'nonfinite'"),
    ({"bucket": 3}, r"unknown option\(s\) \['bucket'\]; valid: candidates"),
    ({"timeout": "abc"}, "'timeout'.*got 'abc'"),
    ({"timeout": -1}, "'timeout'.*got -1"),
    ({"timeout": float("inf")}, "'timeout'.*got inf"),
    ({"timeout": timedelta(seconds=30)}, "'timeout' must be a finite number of seconds"),
    ({"start_method": "bogus"}, "start_method 'bogus'; valid: .*spawn"),
    ({"process_group_backend": "bogus"}, "'process_group_backend' 'bogus'.*available: .*gloo"),
    ({"process_group_backend": "cpu:gloo,cuda:bogus"}, "'process_group_backend' 'cpu:gloo,cuda:bogus'"),
    ({"parallel_devices": 3}, "'parallel_devices' must be a list of torch.device, got 3"),
    ({"find_unused_parameters": True}, "replaces DistributedDataParallel and takes no 'find_unused_parameters': "
                                       "gradsync synchronises parameters that got no gradient"),
    ({"bucket_cap_mb": 25}, "takes no 'bucket_cap_mb'.*scheduler='ddp', bucket_cap_bytes"),
    ({"ddp_comm_hook": print}, "takes no 'ddp_comm_hook'.*compressor="),
    ({"progress_bar": "yes"}, "'progress_bar' must be true or false"),
])
def test_bad_arguments_fail_at_construction_before_any_rank_starts(arguments, message):
    with pytest.raises(ConfigError, match=message):
        GradSyncStrategy(**arguments)


# -- training on 2 ranks ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_trains_identical_replicas(ranks, name):
    first, second = ranks[0][name], ranks[1][name]
    assert distance(first, second) == 0
    assert torch.isfinite(params(first)).all()
    assert distance(first, initial()) > TOLERANCE  # it trained
    # without a logger (Trainer(logger=False)) no warning per statistic; the progress bar shows
    # gradsync's statistics only when asked
    assert first["no_logger_warnings"] == [] and {f"gradsync/{stat}" for stat in STATS} <= set(first["metrics"])
    assert not any(key.startswith("gradsync/") for key in first["progress_bar"])


def test_the_progress_bar_shows_the_statistics_when_asked(ranks):
    assert {f"gradsync/{stat}" for stat in STATS} <= set(ranks[0]["progress_bar/wfbp"]["progress_bar"])
    assert distance(ranks[0]["progress_bar/wfbp"], ranks[0]["wfbp"]) == 0


@pytest.mark.parametrize("name", [*SCHEDULERS, "forest"])
def test_uncompressed_strategies_match_ddp(ranks, name):
    assert distance(ranks[0][name], ranks[0]["ddp"]) < TOLERANCE
    shown = ranks[0][name]["metrics"]
    assert shown["gradsync/bytes_sent"] >= (GRADIENT_NUMEL + USED_FLAGS + 1) * 4
    assert shown["gradsync/compression_ratio"] == pytest.approx(shown["gradsync/bytes_sent"] / (GRADIENT_NUMEL * 4))


def test_wfbp_sends_every_gradient_once(ranks):
    assert ranks[0]["wfbp"]["ops"][-1] == ["plain", 6]  # once timed: one op per tensor
    assert ranks[0]["wfbp"]["metrics"]["gradsync/bytes_sent"] == (GRADIENT_NUMEL + USED_FLAGS + 6) * 4


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_compressors_send_less(ranks, name):
    assert ranks[0][name]["metrics"]["gradsync/compression_ratio"] < 1.0
    assert distance(ranks[0][name], ranks[0]["ddp"]) > TOLERANCE


def test_acp_sgd_sends_its_q_factors_on_the_last_step(ranks):
    """Steps alternate P, Q, P, ... from the first (Algorithm 2): the sixth step is a Q step."""
    shown = ranks[0]["acp_sgd"]["metrics"]
    layout, ops = ranks[0]["acp_sgd"]["ops"][-1]
    assert layout == "Q"
    sent = ACP_Q_NUMEL + USED_FLAGS + ops
    assert shown["gradsync/bytes_sent"] == sent * 4
    assert shown["gradsync/compression_ratio"] == pytest.approx(sent / GRADIENT_NUMEL, rel=1e-6)


@pytest.mark.parametrize("name", ["wfbp", "us_byte"])
@pytest.mark.parametrize("scenario", ["accumulate", "clip", "clip_hook"])
def test_accumulation_and_clipping_act_on_synchronised_gradients(ranks, scenario, name):
    """accumulate_grad_batches, the Trainer's gradient_clip_val and clipping in the module's own
    configure_gradient_clipping: the same training as under DDP."""
    assert distance(ranks[0][f"{scenario}/{name}"], ranks[0][f"{scenario}/ddp"]) < TOLERANCE
    assert distance(ranks[0][f"{scenario}/ddp"], ranks[0]["ddp"]) > TOLERANCE  # the setting changed training


@pytest.mark.parametrize("hook", ["norms", "norms_after_backward"])
def test_on_before_optimizer_step_and_on_after_backward_see_synchronised_gradients(ranks, hook):
    """A callback's on_before_optimizer_step or on_after_backward: the same norms on both ranks,
    as under DDP."""
    expected = ranks[0][f"{hook}/ddp"]["norms"]
    assert len(expected) == STEPS
    for rank in (0, 1):
        assert ranks[rank][f"{hook}/us_byte"]["norms"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("run", ["fp16/acp_sgd", "fp16/hook"])
def test_a_compressors_error_feedback_follows_the_grad_scaler(ranks, run):
    """fp16 AMP with acp_sgd, through the strategy and through the hook's callback: at each step
    gradsync read the scaler's scale for the error feedback (which it rescales at each change;
    the rescaling itself is checked in test_comm_hooks), and the scale did change (back-offs)."""
    for rank in (0, 1):
        result = ranks[rank][run]
        assert "error" not in result, result["error"]
        scales = result["scales"]
        assert len(scales) > 2 and all(scaler == seen for scaler, seen in scales), scales
        assert len({scaler for scaler, _ in scales}) > 1, scales
        assert bool(params(result).isfinite().all())


@pytest.mark.parametrize("name", ["wfbp", "us_byte"])
def test_grad_scaler_unscales_synchronised_gradients(ranks, name):
    """fp16 AMP: the scaler unscales inside the closure and skips steps with overflowed gradients."""
    assert distance(ranks[0][f"fp16/{name}"], ranks[0]["fp16/ddp"]) < TOLERANCE
    assert distance(ranks[0]["fp16/ddp"], initial()) > TOLERANCE  # not every step was skipped
    assert distance(ranks[0]["fp16/ddp"], ranks[0]["ddp"]) > TOLERANCE  # some were


@pytest.mark.parametrize("name", ["wfbp", "us_byte"])
def test_buffers_and_validation_match_ddp(ranks, name):
    """Per rank: training_step calls the inner network, so only the strategy's redirection through
    the module's call broadcasts rank 0's buffers before each forward, as DDP does."""
    for rank in (0, 1):
        runs = ranks[rank]
        assert distance(runs[f"batchnorm/{name}"], runs["batchnorm/ddp"]) < TOLERANCE
        assert runs[f"batchnorm/{name}"]["metrics"]["val_loss"] == pytest.approx(
            runs["batchnorm/ddp"]["metrics"]["val_loss"], abs=TOLERANCE)


def test_weight_averaging_sees_and_keeps_the_updates_deferred_to_the_next_forward(ranks):
    """StochasticWeightAveraging under updates deferred to the layers' next forward: each epoch's last
    update is applied before it averages, and its average is not overwritten by that update later."""
    for rank in (0, 1):
        assert distance(ranks[rank]["swa/us_byte"], ranks[rank]["swa/ddp"]) < TOLERANCE
    assert distance(ranks[0]["swa/ddp"], ranks[0]["ddp"]) > TOLERANCE


@pytest.mark.parametrize("name", ["wfbp", "us_byte", "gradsync_auto"])
def test_a_backbone_unfrozen_by_backbone_finetuning_trains_as_on_one_device_with_both_ranks_batches(
        ranks, name, tmp_path):
    """The callback freezes the backbone before the strategy attaches and unfreezes it at the second
    epoch: the runtime takes it in at the next forward, every rank alike (Lightning's own ddp leaves
    it out, each rank training its own). One device, each batch the two ranks' batches together,
    takes the same averaged gradients."""
    reference = fit_backbone_finetuning("auto", tmp_path, batches(16), devices=1)
    assert backbone_moved(reference) > TOLERANCE
    for rank in (0, 1):
        assert distance(ranks[rank][f"backbone/{name}"], reference) < TOLERANCE


def test_a_backbone_unfrozen_by_backbone_finetuning_trains_under_acp_sgd_with_the_replicas_equal(ranks):
    """The codec keeps the head's state and starts the backbone's (``Codec.take_in``)."""
    assert backbone_moved(ranks[0]["backbone/acp_sgd"]) > TOLERANCE
    assert distance(ranks[0]["backbone/acp_sgd"], ranks[1]["backbone/acp_sgd"]) == 0


def test_an_ema_updated_at_each_batch_end_sees_the_updates_deferred_to_the_next_forward(ranks):
    """EMAWeightAveraging reads the parameters through parameters() after each step, which applies
    the updates still waiting for their layer's next forward; the average is the model's at the end."""
    for rank in (0, 1):
        assert distance(ranks[rank]["ema/us_byte"], ranks[rank]["ema/ddp"]) < TOLERANCE
    assert distance(ranks[0]["ema/ddp"], ranks[0]["ddp"]) > TOLERANCE


def test_manual_optimization_matches_ddp(ranks):
    """The gradients the model clips between manual_backward and step are the averaged ones."""
    assert distance(ranks[0]["manual/us_byte"], ranks[0]["manual/ddp"]) < TOLERANCE
    assert distance(ranks[0]["manual/ddp"], ranks[0]["ddp"]) > TOLERANCE  # clipping was active
    assert {f"gradsync/{name}" for name in STATS} <= set(ranks[0]["manual/us_byte"]["metrics"])


def test_two_optimizers_under_manual_optimization_match_ddp(ranks):
    """A GAN's two optimizers (gradsync.wrap takes both): every manual_backward is averaged, and
    each optimizer steps its own parameters, as under Lightning's DDP."""
    for name in ("wfbp", "us_byte"):
        assert distance(ranks[0][f"gan/{name}"], ranks[0]["gan/ddp"]) < TOLERANCE, name
    assert distance(ranks[0]["gan/us_byte"], ranks[1]["gan/us_byte"]) == 0


def test_two_optimizers_with_acp_sgd_resume_exactly_from_a_trainer_checkpoint(ranks):
    for rank in (0, 1):
        runs = ranks[rank]["gan_resume"]
        assert distance(runs["resumed"], runs["straight"]) == 0
        assert distance(runs["first_epoch"], runs["straight"]) > TOLERANCE


def test_acp_sgd_resumes_exactly_from_a_trainer_checkpoint(ranks):
    for rank in (0, 1):
        runs = ranks[rank]["resume"]
        assert distance(runs["resumed"], runs["straight"]) == 0
    assert ranks[0]["resume"]["saved"] == {"step": 3, "error_feedback_ranks": 2}


def test_resume_without_gradsync_state_diverges(ranks):
    """The control: the codec state in the checkpoint is what makes the resume exact."""
    runs = ranks[0]["resume"]
    assert distance(runs["resumed_without_gradsync_state"], runs["straight"]) > TOLERANCE


# -- Lightning's own launchers ------------------------------------------------------------------------
def test_spawn_launcher_trains_like_the_external_launch(ranks, tmp_path):
    torch.manual_seed(0)
    model = Classifier()
    trainer = trainer_for(GradSyncStrategy("us_byte", start_method="spawn", timeout=60.0), tmp_path)
    trainer.fit(model, batches())  # the launcher loads rank 0's final weights into `model`
    assert distance({"params": flat(model)}, ranks[0]["us_byte"]) < TOLERANCE
    assert {f"gradsync/{name}" for name in STATS} <= set(trainer.callback_metrics)


def csv_logged_run(directory: Path) -> None:
    """Run as a script: the user path, with the registered name and Lightning's default launcher."""
    torch.manual_seed(0)
    plan_ops = PlanOps()
    trainer = trainer_for("acp_sgd", directory, max_steps=4, logger=CSVLogger(directory, name="csv", version=0),
                          callbacks=[plan_ops])
    trainer.fit(Classifier(), batches())
    if trainer.is_global_zero:
        (directory / "ops.json").write_text(json.dumps(plan_ops.ops))


def test_registered_name_logs_gradsync_stats_to_csv(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    announced = [line for line in done.stderr.splitlines() if line.startswith("gradsync (optimal_merge, compressor acp_sgd)")]
    assert len(announced) == 2, done.stderr[-3000:]  # rank 0 alone, at the attach and once the plan is chosen
    assert "attached in" in announced[0] and "timing the layers" in announced[0]
    assert "chosen after" in announced[1] and "P: optimal_merge plan of" in announced[1] and "Q: " in announced[1]
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("gradsync/bytes_sent")]
    assert [int(row["step"]) for row in rows] == [0, 1, 2, 3]
    ops = json.loads((tmp_path / "ops.json").read_text())
    assert [layout for layout, _ in ops] == ["P", "Q", "P", "Q"]  # Algorithm 2 alternates from P
    for row, (layout, op_count) in zip(rows, ops):
        sent = (ACP_P_NUMEL if layout == "P" else ACP_Q_NUMEL) + USED_FLAGS + op_count
        assert float(row["gradsync/bytes_sent"]) == sent * 4
        assert float(row["gradsync/compression_ratio"]) == pytest.approx(sent / GRADIENT_NUMEL, rel=1e-6)
        assert 0 <= float(row["gradsync/comm_wait"]) <= float(row["gradsync/iteration_time"])
        assert 0 < float(row["gradsync/codec_time"]) < float(row["gradsync/iteration_time"])


CLI_CONFIG = """
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 4
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  strategy:
    class_path: gradsync.strategies.GradSyncStrategy
    init_args:
      scheduler: us_byte
      compressor: {type: acp_sgd, rank: 2}
      options: {partition_bytes: 4096}
"""


def test_the_compression_hook_callback_runs_under_lightnings_ddp_and_resumes_exactly(ranks):
    for run in ranks:
        runs = run["hook_resume"]
        assert [runs[key]["hook_steps"] for key in ("straight", "first_epoch", "resumed")] == [6, 3, 6], runs
        assert distance(runs["resumed"], runs["straight"]) == 0.0
    assert distance(ranks[0]["hook_resume"]["straight"], ranks[1]["hook_resume"]["straight"]) == 0.0


def test_lightning_cli_takes_the_strategy_by_class_path_from_yaml(tmp_path):
    """LightningCLI in a script that does not import gradsync: jsonargparse imports the class named
    in the YAML, and its init_args reach the strategy (planner options through `options`)."""
    (tmp_path / "config.yaml").write_text(CLI_CONFIG)
    job = Path(__file__).with_name("lightning_cli_job.py")
    assert "gradsync" not in job.read_text().split('"""')[2]  # the script's code never names it
    done = subprocess.run([sys.executable, str(job), "config.yaml", "ran.json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    ran = json.loads((tmp_path / "ran.json").read_text())
    assert ran["strategy"] == "gradsync.strategies.GradSyncStrategy" and ran["iterations"] == 4
    assert ran["scheduler"] == "us_byte {'partition_bytes': 4096}" and ran["compressor"] == "acp_sgd"
    assert ran["codec"]["rank"] == 2


def test_options_as_a_mapping_and_as_keywords_are_one_set():
    assert GradSyncStrategy("us_byte", options={"partition_bytes": 4096}).gradsync_options == {"partition_bytes": 4096}
    with pytest.raises(ConfigError, match=r"\['partition_bytes'\] given both"):
        GradSyncStrategy("us_byte", options={"partition_bytes": 4096}, partition_bytes=2048)
    with pytest.raises(ConfigError, match="'options' must be a mapping"):
        GradSyncStrategy("us_byte", options=[("partition_bytes", 4096)])


GPU_RUNS = ("acp_sgd", "us_byte", "ddp")


def fit_with_comm_hook(compressor, root, **options) -> dict:
    """Lightning's own DDPStrategy with gradsync's communication hook (Lightning registers hooks on
    CUDA devices only): the final parameters and how many steps the hook synchronised."""
    from gradsync.comm_hooks import CompressionState, compression_hook

    pl.seed_everything(0, verbose=False)
    model = Classifier()
    state = CompressionState(model, compressor)
    trainer = trainer_for(DDPStrategy(ddp_comm_state=state, ddp_comm_hook=compression_hook), root, **options)
    trainer.fit(model, batches())
    return {"params": flat(model), "hook_steps": state.step}


def gpu_runs(directory: Path) -> None:
    """Run as a script on a CUDA machine: the registered names with `accelerator="gpu", devices=1`,
    Lightning initialising the process group (NCCL) itself, and DDPStrategy with gradsync's
    communication hook; each run's record as JSON."""
    runs = {name: fit(name, directory, accelerator="gpu", devices=1) for name in GPU_RUNS}
    for compressor in ("identity", "acp_sgd"):
        runs[f"comm_hook/{compressor}"] = fit_with_comm_hook(compressor, directory, accelerator="gpu", devices=1)
    (directory / "gpu_runs.json").write_text(json.dumps(runs))


@pytest.mark.gpu
def test_registered_names_train_on_one_gpu(tmp_path, record_property):
    done = subprocess.run([sys.executable, __file__, "--gpu", str(tmp_path)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads((tmp_path / "gpu_runs.json").read_text())
    record_property("us_byte_from_ddp", distance(runs["us_byte"], runs["ddp"]))
    assert distance(runs["us_byte"], runs["ddp"]) < TOLERANCE
    acp = runs["acp_sgd"]
    assert [layout for layout, _ in acp["ops"]] == ["P", "Q"] * (STEPS // 2)  # Algorithm 2 alternates from P
    assert {f"gradsync/{name}" for name in STATS} <= set(acp["metrics"])
    assert distance(acp, initial()) > TOLERANCE and all(map(math.isfinite, acp["params"]))
    hooked = runs["comm_hook/identity"], runs["comm_hook/acp_sgd"]
    assert [run["hook_steps"] for run in hooked] == [STEPS, STEPS]  # the hook ran at every step
    assert distance(hooked[0], runs["ddp"]) < TOLERANCE  # the identity hook is DDP's averaging
    assert distance(hooked[1], initial()) > TOLERANCE and all(map(math.isfinite, hooked[1]["params"]))


if __name__ == "__main__":
    if sys.argv[1] == "--gpu":
        gpu_runs(Path(sys.argv[2]))
    else:
        csv_logged_run(Path(sys.argv[1]))

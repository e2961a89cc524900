"""gradsync.deepspeed: config checks in-process (no collective may start), and a real 2-rank job
started by the ``deepspeed`` launcher on CPU (tests/deepspeed_job.py)."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

deepspeed = pytest.importorskip("deepspeed")

import gradsync.deepspeed  # noqa: E402
from gradsync import ConfigError  # noqa: E402
from gradsync.launch import free_port, run_local  # noqa: E402

JOB = Path(__file__).with_name("deepspeed_job.py")
BASE = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def stub_engine_constructor(monkeypatch, constructor) -> None:
    """``deepspeed.initialize`` in this process without a process group, with DeepSpeed's own
    engine constructor (the one gradsync's entry wraps) replaced by `constructor`."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    monkeypatch.setattr(deepspeed.comm, "init_distributed", lambda *args, **kwargs: None)
    original = DeepSpeedEngine.__init__.__wrapped__
    monkeypatch.setattr(DeepSpeedEngine.__init__, "__wrapped__", functools.wraps(original)(constructor))


@pytest.fixture
def no_deepspeed_start(monkeypatch):
    """Fail the test if DeepSpeed's engine is built (it would broadcast the weights)."""
    def started(*args, **kwargs):
        raise AssertionError("DeepSpeed's engine was built")

    stub_engine_constructor(monkeypatch, started)


def refused(section: dict | None = None, *, model: nn.Module | None = None, **config) -> str:
    ds_config = {**BASE, **config}
    if section is not None:
        ds_config["gradsync"] = section
    model = nn.Linear(4, 2) if model is None else model
    with pytest.raises(ConfigError) as error:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    assert not torch.distributed.is_initialized()
    return str(error.value)


def bare_engine(engine, args, model, **kwargs) -> None:
    """A stand-in for DeepSpeed's engine constructor: what ``deepspeed.initialize`` reads after it."""
    nn.Module.__init__(engine)
    engine._config, engine.optimizer, engine.training_dataloader, engine.lr_scheduler = (
        kwargs["config_class"], None, None, None)


@pytest.fixture
def built_engines(monkeypatch):
    """DeepSpeed's engine constructor and gradsync's attach stubbed: the constructor's arguments
    per engine built, and the checked arguments each attach received."""
    built = SimpleNamespace(constructed=[], attached=[])

    def constructed(engine, args, model, **kwargs):
        bare_engine(engine, args, model, **kwargs)
        built.constructed.append({"args": args, "model": model, **kwargs})

    stub_engine_constructor(monkeypatch, constructed)
    monkeypatch.setattr(gradsync.deepspeed.engine, "attach", lambda engine, checked: built.attached.append(checked))
    return built


@pytest.fixture
def attach_arguments(built_engines):
    """The checked arguments each engine built attached."""
    return built_engines.attached


def accepted(section: dict, **config) -> None:
    model = nn.Linear(4, 2)
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config={**BASE, **config, "gradsync": section})


def test_unknown_key_lists_valid_keys(no_deepspeed_start):
    message = refused({"scheduler": "wfbp", "bucket_mb": 25})
    assert "bucket_mb" in message
    assert all(key in message for key in ("scheduler", "compressor", "channels", "options", "transport"))


def test_zero_stage_3(no_deepspeed_start):
    message = refused({"scheduler": "wfbp"}, zero_optimization={"stage": 3})
    assert "stage 3" in message and "no rank ever holds a whole gradient" in message and "use stage 1 or 2" in message


@pytest.mark.parametrize("stage", ["0", 0.0])
def test_zero_stage_0_as_deepspeed_reads_it(attach_arguments, stage):
    accepted({}, zero_optimization={"stage": stage})
    assert len(attach_arguments) == 1


def test_wrap_arguments_at_the_top_level(attach_arguments):
    accepted({"scheduler": "wfbp", "warmup_iterations": 0, "measure_iterations": 2, "plan_trials": 1,
              "broadcast_buffers": True, "cost": {"a": 1e-3, "b": 1e-8, "gamma": 1.5}})
    [arguments] = attach_arguments
    assert (arguments.warmup_iterations, arguments.measure_iterations, arguments.plan_trials,
            arguments.broadcast_buffers) == (0, 2, 1, True)
    assert (arguments.cost.a, arguments.cost.b, arguments.cost.gamma) == (1e-3, 1e-8, 1.5)


def test_buffers_stay_each_ranks_own_unless_asked_as_under_deepspeed(attach_arguments):
    """DeepSpeed never broadcasts buffers (BatchNorm's statistics): neither does the section by default."""
    accepted({})
    assert attach_arguments[0].broadcast_buffers is False


def test_a_model_whose_engine_was_not_destroyed_is_refused_before_another_starts(no_deepspeed_start, monkeypatch):
    """A second deepspeed.initialize on a model gradsync is attached to would launch every op twice."""
    from gradsync.runtime import engine

    model = nn.Linear(4, 2)
    monkeypatch.setitem(engine._ATTACHED, model, object())  # as an engine built on it earlier leaves it
    assert "under DeepSpeed, the engine's destroy()" in refused({}, model=model)


def test_a_cost_model_given_in_the_section_is_checked_by_its_fields(no_deepspeed_start):
    assert "unknown key(s) ['alpha']" in refused({"cost": {"alpha": 1e-3, "b": 1e-8}})


@pytest.mark.parametrize("changes, needle", [
    ({"tensor_parallel": {"autotp_size": 2}}, "'tensor_parallel.autotp_size' 2"),
    ({"sequence_parallel_size": 2}, "'sequence_parallel_size' 2"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, "'expert_parallel.enabled' True"),
])
def test_model_parallelism(no_deepspeed_start, changes, needle):
    message = refused({}, **changes)
    assert needle in message and "averages every parameter's gradient over all ranks" in message


def test_moe_experts(no_deepspeed_start):
    from deepspeed.moe.layer import MoE

    model = nn.Sequential(nn.Linear(4, 4), MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2, ep_size=1))
    message = refused({}, model=model)
    assert "MoE" in message and "1.deepspeed_moe.experts.deepspeed_experts.0.weight" in message


def test_sparse_gradients(no_deepspeed_start):
    assert "sparse" in refused({}, model=nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))


def test_communication_data_type_other_than_fp32(attach_arguments):
    assert "'communication_data_type' 'fp16'" in refused({}, communication_data_type="fp16")
    accepted({}, communication_data_type="fp32")
    assert len(attach_arguments) == 1


def test_compressor_with_compressed_optimizer(no_deepspeed_start):
    message = refused({"compressor": {"type": "acp_sgd", "rank": 4}},
                      optimizer={"type": "OneBitAdam", "params": {"lr": 1e-3}})
    assert "acp_sgd" in message and "onebitadam" in message


@pytest.mark.parametrize("section, needle", [
    ({"transport": "trees"}, "valid: allreduce, forest"),
    ({"transport": "forest", "topology": "torus-3"}, "unknown preset 'torus-3'"),
    ({"topology": "ring-2"}, "transport 'forest' only"),
])
def test_bad_transport_or_topology(no_deepspeed_start, section, needle):
    message = refused(section)
    assert "gradsync.t" in message and needle in message


def test_bad_scheduler_names_key_and_choices(no_deepspeed_start):
    message = refused({"scheduler": "fastest"})
    assert "gradsync.scheduler" in message and "us_byte" in message and "mg_wfbp" in message


@pytest.mark.parametrize("section, key", [
    ({"channels": 0}, "gradsync.channels"),
    ({"timeout": -1}, "gradsync.timeout"),
    ({"nonfinite": "zero"}, "gradsync.nonfinite"),
    ({"profile": "missing.json"}, "gradsync.profile"),
    ({"compressor": {"rank": 4}}, "gradsync.compressor"),
    ({"compressor": "gzip"}, "gradsync.compressor"),
    ({"compressor": {"type": "acp_sgd", "rnak": 4}}, "gradsync.compressor"),
    ({"options": {"channels": 3}}, "gradsync.options"),
    ({"scheduler": "bytescheduler", "options": {"partition_bytes": 0}}, "gradsync.options.partition_bytes"),
    ({"scheduler": "bytescheduler", "channels": 2, "options": {"credit": 2, "partition_bytes": -5}},
     "gradsync.options.partition_bytes"),
    ({"scheduler": "us_byte", "options": {"partition_bytes": 4096, "credit": 2}}, "gradsync.options.credit"),
    ({"options": {"bucket_cap_bytes": 1}}, "gradsync.options.bucket_cap_bytes"),  # auto takes no such option
    ({"options": [1]}, "gradsync.options"),
    ({"scheduler": ["wfbp"]}, "gradsync.scheduler"),
    ({"compressor": {"type": ["acp_sgd"]}}, "gradsync.compressor"),
    ({"warmup_iterations": -1}, "gradsync.warmup_iterations"),
    ({"broadcast_buffers": "no"}, "gradsync.broadcast_buffers"),
])
def test_bad_values_name_the_key(no_deepspeed_start, section, key):
    assert key in refused(section)


ZERO_2 = {"zero_optimization": {"stage": 2}}


@pytest.mark.parametrize("changes, needle", [
    ({"torch_autocast": {"enabled": True, "dtype": "fp16"}}, "torch_autocast"),
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "'zero_optimization.offload_optimizer'"),
    ({**ZERO_2, "data_types": {"grad_accum_dtype": "fp32"}}, "'data_types.grad_accum_dtype'"),
    ({**ZERO_2, "bf16": {"enabled": True}, "communication_data_type": "fp32"}, "set 'bf16'"),
    ({"gradient_allreduce_op": "sum"}, "'gradient_allreduce_op' must be \"mean\""),
    ({**ZERO_2, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "'torch_autocast.lower_precision_safe_modules'"),
])
def test_deepspeed_settings_gradsync_cannot_serve(no_deepspeed_start, changes, needle):
    assert needle in refused({}, **changes)


@pytest.mark.parametrize("changes", [
    {**ZERO_2, "torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}},
    {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},  # stage 0 reduces in the gradients' dtype
])
def test_autocast_is_served_where_every_gradient_is_reduced_in_its_own_dtype(attach_arguments, changes):
    accepted({}, **changes)
    assert len(attach_arguments) == 1


def test_fp16_overflows_are_not_errors(no_deepspeed_start):
    """DeepSpeed's loss scaler skips overflowing fp16 steps: "raise" is refused."""
    assert "'gradsync.nonfinite' 'raise'" in refused({"nonfinite": "raise"}, fp16={"enabled": True}, **ZERO_2)


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("precision", ["fp16", "bf16", None])
def test_overflows_reach_deepspeeds_own_check_under_mixed_precision_and_zero(attach_arguments, precision, stage):
    """Where DeepSpeed's optimizer checks the averaged gradients for overflow (fp16, bf16, ZeRO), the
    default lets them through to it; where the user's optimizer steps (stage 0 in fp32), it raises."""
    default = "raise" if precision is None and stage == 0 else "ignore"
    zero = {"zero_optimization": {"stage": stage}}
    accepted({}, **zero, **({precision: {"enabled": True}} if precision else {}))
    accepted({"nonfinite": "skip"}, **zero, **({precision: {"enabled": True}} if precision else {}))
    assert [arguments.nonfinite for arguments in attach_arguments] == [default, "skip"]


def test_needs_an_optimizer(no_deepspeed_start):
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="optimizer"):
        deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 4, "gradsync": {}})


def test_section_read_from_json_path(no_deepspeed_start, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "gradsync": {"schedular": "wfbp"}}))
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="schedular"):
        deepspeed.initialize(model=model, config=str(path))


def test_section_read_from_the_engine_whoever_builds_it(no_deepspeed_start):
    """Lightning's DeepSpeedStrategy, Accelerate and HF's Trainer call deepspeed.initialize; a
    caller may also build the engine itself, or hold an initialize bound before gradsync loaded."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    config = {**BASE, "gradsync": {"scheduler": "fastest"}}
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="gradsync.scheduler"):
        DeepSpeedEngine(args=None, model=model, config=config, config_class=DeepSpeedConfig(config))


def test_hybrid_engine(no_deepspeed_start):
    assert "hybrid engine" in refused({}, hybrid_engine={"enabled": True})


def test_without_section_is_plain_deepspeed(built_engines):
    model = nn.Linear(4, 2)
    engine, optimizer, _, _ = gradsync.deepspeed.initialize(model=model, config=BASE, dist_init_required=False)
    assert type(engine).__name__ == "DeepSpeedEngine" and built_engines.attached == []
    [constructed] = built_engines.constructed
    assert constructed["model"] is model and constructed["config"] == BASE


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory):
    """Run tests/deepspeed_job.py on 2 CPU ranks with the deepspeed launcher; its result.json."""
    launcher = Path(sys.executable).with_name("deepspeed")
    if not launcher.exists():
        launcher = shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not installed")
    out = tmp_path_factory.mktemp("deepspeed_job")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    command = [str(launcher), "--num_accelerators", "2", "--master_port", str(free_port()), str(JOB), "--out", str(out)]
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-4000:]
    return {**json.loads((out / "result.json").read_text()), "console": finished.stdout + finished.stderr}


def test_launcher_runs_two_cpu_ranks_on_gloo(two_rank_job):
    assert (two_rank_job["world_size"], two_rank_job["backend"], two_rank_job["accelerator"]) == (2, "gloo", "cpu")


@pytest.mark.parametrize("run", ["uncompressed", "uncompressed_clipped"])
def test_uncompressed_us_byte_matches_ddp(two_rank_job, run):
    """The clipped run's ops travel over the forest transport (the complete graph of the 2 ranks)."""
    result = two_rank_job[run]
    assert result["transport"] == ("forest" if run == "uncompressed_clipped" else "allreduce")
    assert result["engine_class"] == "GradSyncDeepSpeedEngine" and result["backward_allreduce"] is False
    assert result["global_steps"] == 8  # 16 micro-batches, accumulation 2
    assert result["synchronised_backward_passes"] == 8  # only the accumulation boundaries communicate
    assert result["max_abs_difference_to_ddp"] <= 1e-6


def test_statistics_reach_deepspeeds_monitor_and_the_plan_its_log(two_rank_job):
    """Each optimizer step's statistics, in DeepSpeed's csv monitor (rank 0's, one row per global
    step at its sample count); the plan, logged once on rank 0 when chosen."""
    written = two_rank_job["uncompressed"]["monitor"]
    names = ("iteration_time", "predicted_time", "comm_wait", "codec_time", "bytes_sent", "compression_ratio")
    assert {f"Train_gradsync_{name}" for name in names} <= set(written)
    header, *rows = written["Train_gradsync_compression_ratio"]
    samples = [int(row.split(",")[0]) for row in rows]
    assert samples == [2 * 2 * 8 * (step + 1) for step in range(8)]  # 2 ranks, accumulation 2, micro-batch 8
    assert all(float(row.split(",")[1]) > 1.0 for row in rows)  # uncompressed: data plus the flags
    lines = [line for line in two_rank_job["console"].splitlines() if "gradsync (us_byte" in line]
    assert all("[Rank 0]" in line for line in lines), lines
    # the job's first two runs (us_byte): each attached with its layers timed first, then the plan chosen once
    lines = lines[:4]
    assert [line.split("gradsync (us_byte, compressor identity): ")[1].split(" ")[0] for line in lines] == [
        "attached", "chosen"] * 2, lines
    assert all("timing the layers" in line for line in lines[::2])
    assert all("plain: us_byte plan of" in line and "ms predicted" in line for line in lines[1::2])


def test_uncompressed_run_deferred_updates_into_the_next_forward(two_rank_job):
    assert two_rank_job["uncompressed"]["forward_phase_ops"] > 0


ACP_RUNS = {"acp_sgd": "DeepSpeedSyncedOptimizer", "acp_sgd_bf16": "GradSyncFP16_UnfusedOptimizer",
            "acp_sgd_zero1": "GradSyncDeepSpeedZeroOptimizer", "acp_sgd_zero2": "GradSyncDeepSpeedZeroOptimizer"}
# ZeRO stage 0 in fp32 and in bf16 (DeepSpeed's bf16 optimizer taken over), stages 1 and 2


@pytest.mark.parametrize("run", ACP_RUNS)
def test_acp_sgd_loss_decreases_and_replicas_agree(two_rank_job, run):
    result = two_rank_job[run]
    assert result["codec"] == "acp_sgd"
    assert result["optimizer"] == ACP_RUNS[run]
    losses = result["losses"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    first, second = result["replica_checksums"]
    assert first == second


@pytest.mark.parametrize("run", ACP_RUNS)
def test_checkpoint_carries_gradsync_state(two_rank_job, run):
    """DeepSpeed's checkpoint holds gradsync's codec state and step (under ZeRO in each rank's
    optimizer file); a resumed run replays the steps after it bit-identically."""
    result = two_rank_job[run]
    assert result["checkpoint_gradsync"] == {"codec": "acp_sgd", "step": 16, "world_size": 2}
    assert result["checkpoint_per_rank_entries"] == 2  # each rank's error feedback
    assert (result["steps_before_load"], result["restored_sync_steps"]) == (20, 16)
    assert result["replay_max_abs_difference"] == 0.0


@pytest.mark.parametrize("run", ACP_RUNS)
def test_a_compressors_zero_step_hands_the_host_heaps_free_pages_back(two_rank_job, run):
    """Under ZeRO on the host, a compressor's plan (whole gradients held until the step) releases the
    heap's free pages in every step: 24 steps and 4 replayed after the checkpoint's load. Not at
    stage 0, where DeepSpeed's optimizer keeps whole gradients anyway."""
    assert two_rank_job[run]["host_memory_releases"] == (24 + 4 if "zero" in run else 0)


def test_every_scheduler_under_zero_stages_trains_as_deepspeed_does(two_rank_job):
    """10 steps of SGD with momentum, accumulation 2 and clipping at 0.5, beside DeepSpeed's own run
    of the same config: within fp32 rounding (1e-6) in fp32; in bf16 equal at stage 1, and at
    stage 2 within one unit of bf16's last place at the largest parameter's magnitude: there
    DeepSpeed reduces each micro-batch's gradients and sums the results in bf16, gradsync the
    summed ones, and the roundings differ (an eighth of that unit seen).
    Replicas agree bitwise; under ZeRO each rank receives its partition alone (reduce-scatters)."""
    runs = two_rank_job["stages"]
    assert len(runs) == 4 * 8 + 2
    for name, run in runs.items():
        stage, precision, _ = name.split()
        assert run["replicas_equal"] and run["global_steps"] == 10, name
        assert run["host_memory_releases"] == 0, name  # reduce-scatter plans free the gradients in the backward pass
        if precision == "fp32":
            assert run["max_abs_difference"] <= 1e-6, (name, run)
        else:
            assert run["bf16_ulps"] <= (1 if stage == "2" else 0), (name, run)
        if stage != "0":
            assert run["optimizer"] == "GradSync" + run["deepspeed_optimizer"] == "GradSyncDeepSpeedZeroOptimizer"
            assert run["collectives"] == ["reduce_scatter"], name
        elif precision == "bf16":  # DeepSpeed's bf16 optimizer, taken over
            assert run["optimizer"] == "GradSync" + run["deepspeed_optimizer"] == "GradSyncFP16_UnfusedOptimizer"


def test_a_nan_under_zero_in_fp32_is_skipped_as_deepspeed_skips_it(two_rank_job):
    result = two_rank_job["nan_zero2"]
    assert result["skipped_steps"] == [1, 1] and result["finite"]
    assert result["max_abs_difference"] <= 1e-6


def test_coalesced_reduction_is_refused_naming_the_boundaries_which_train_alike(two_rank_job):
    result = two_rank_job["coalesced"]
    assert "set_gradient_accumulation_boundary(False)" in result["refusal"]
    assert result["max_abs_difference"] <= 1e-6


def test_a_layer_no_rank_uses_gets_zeros_as_under_deepspeeds_all_reduce(two_rank_job):
    """Momentum and weight decay move a layer on the steps where no rank used it, as under DeepSpeed."""
    assert two_rank_job["unused_layer"] == {"wfbp": pytest.approx(0, abs=1e-6), "us_byte": pytest.approx(0, abs=1e-6)}


def test_a_layer_frozen_at_initialize_and_unfrozen_later_trains_as_under_deepspeeds_own_all_reduce(two_rank_job):
    result = two_rank_job["unfrozen_layer"]
    assert result["moved"] > 1e-3
    assert result["wfbp"] == pytest.approx(0, abs=1e-6) and result["us_byte"] == pytest.approx(0, abs=1e-6)


def skipped_as_deepspeed_skips(fp16: dict, run: str) -> None:
    """fp16 under ZeRO-2, whose first steps overflow (loss scale 2^20), or at stage 0 under
    DeepSpeed's fp16 optimizer, where one batch overflows: DeepSpeed's loss scaler sees gradsync's
    averaged gradients, skips the overflowing steps on every rank and lowers the scale (not below
    1); a skipped step is no compressor step (acp_sgd's P/Q alternation goes on), also where only
    the decoded gradient overflows. Uncompressed, the same steps as in DeepSpeed's own run, the same
    scale, the parameters within fp16 rounding of the updates. acp_sgd forms its factors in fp32,
    but its decoded gradient approximates M + E, whose entries can exceed M's: it skips at least as
    many steps (on the CPU the same)."""
    deepspeed_run, ours = fp16["deepspeed"], fp16[run]
    steps = deepspeed_run["global_steps"]
    assert 0 < deepspeed_run["skipped_steps"] < steps and deepspeed_run["finite"]
    assert ours["global_steps"] == steps and ours["finite"] and ours["replicas_equal"]
    assert 0 < ours["compressor_steps"] == ours["global_steps"] - ours["skipped_steps"]
    # each change of DeepSpeed's loss scale (back-offs, and growth after loss_scale_window good
    # steps) rescales the error feedback by the same factor
    assert ours["scale_changes"] and ours["errors_rescaled"] == ours["scale_changes"]
    assert any(factor > 1 for factor in deepspeed_run["scale_changes"])
    if run == "us_byte":
        assert (ours["skipped_steps"], ours["loss_scale"]) == (deepspeed_run["skipped_steps"],
                                                               deepspeed_run["loss_scale"])
        assert ours["max_abs_difference"] <= 2e-3, ours
    else:
        assert ours["skipped_steps"] >= deepspeed_run["skipped_steps"]
        assert ours["loss_scale"] <= deepspeed_run["loss_scale"]


@pytest.mark.parametrize("stage", ["fp16", "fp16_stage0"])  # ZeRO stage 2's optimizer, DeepSpeed's fp16 one at stage 0
@pytest.mark.parametrize("run", ["us_byte", "acp_sgd"])
def test_fp16_overflows_are_skipped_as_deepspeed_skips_them(two_rank_job, run, stage):
    skipped_as_deepspeed_skips(two_rank_job[stage], run)


@pytest.mark.gpu
def test_fp16_overflows_are_skipped_as_deepspeed_skips_them_on_cuda(tmp_path):
    """The same fp16 runs on one CUDA rank (NCCL), DeepSpeed's CUDA accelerator and its own fp16."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    env.pop("DS_ACCELERATOR", None)
    done = subprocess.run([sys.executable, str(JOB), "--out", str(tmp_path), "--cuda"], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["backend"], result["accelerator"]) == ("nccl", "cuda")
    for stage in ("fp16", "fp16_stage0"):
        for run in ("us_byte", "acp_sgd"):
            skipped_as_deepspeed_skips(result[stage], run)


def test_skipped_step_is_reported_to_deepspeed(two_rank_job):
    """As plain DeepSpeed on the same batches without the skipped one, and counted as its fp16
    overflow skips are (a global step, not applied, the LR schedule held)."""
    result = two_rank_job["skip"]
    assert (result["applied_when_skipped"], result["skipped_steps"], result["global_steps"]) == (False, 1, [6, 5])
    gradsync_lr, plain_lr = result["lr"]
    assert gradsync_lr == plain_lr
    assert result["max_abs_difference_to_plain"] <= 1e-6


def lightning_deepspeed_run(tmp_path: Path, device: str) -> dict:
    """tests/lightning_deepspeed_job.py on `device`: what ran, and the csv monitor's rows."""
    (tmp_path / "cost.json").write_text(json.dumps({"a": 1e-4, "b": 1e-9, "gamma": 1.0}))
    job = Path(__file__).with_name("lightning_deepspeed_job.py")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **({"DS_ACCELERATOR": "cpu"} if device == "cpu" else {})}
    done = subprocess.run([sys.executable, str(job), str(tmp_path), device], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    monitor = tmp_path / "monitor" / "lightning"
    return {**json.loads((tmp_path / "ran.json").read_text()),
            "monitor": {path.stem: path.read_text().splitlines()[1:] for path in monitor.glob("*.csv")}}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_lightnings_deepspeed_strategy_runs_gradsync_from_the_config(tmp_path, device):
    """Lightning's DeepSpeedStrategy(config=...) with the section, `import gradsync` coming before
    DeepSpeed is loaded (its engine's constructor is wrapped as its module loads; the 2-rank job
    imports gradsync after DeepSpeed): the engine runs gradsync's plan, and gradsync's statistics
    reach DeepSpeed's monitor."""
    ran = lightning_deepspeed_run(tmp_path, device)
    assert ran["deepspeed_before_gradsync"] is False
    assert (ran["engine"], ran["scheduler"], ran["backward_allreduce"]) == ("GradSyncDeepSpeedEngine", "wfbp", False)
    assert ran["iterations"] == 6 and len(set(ran["replica_sums"])) == 1
    assert len(ran["monitor"]["Train_gradsync_iteration_time"]) == 6
    assert all(float(row.split(",")[1]) > 0 for row in ran["monitor"]["Train_gradsync_bytes_sent"])


def gathered_in_pieces(rank, world_size):
    """Two groups' partitions (not multiples of a piece) gathered in 40-byte pieces, beside one
    all-gather of the same; and ZeRO's module holds DeepSpeed's own function again after."""
    import torch.distributed as dist
    from deepspeed.runtime.zero import stage_1_and_2

    from gradsync.deepspeed import gather

    own = stage_1_and_2.all_gather_dp_groups
    gather.PIECE_BYTES = 40
    flats = [torch.zeros(world_size * size) for size in (23, 5)]
    partitions = [list(flat.split(flat.numel() // world_size)) for flat in flats]
    for group, parts in enumerate(partitions):
        parts[rank].copy_(torch.arange(parts[rank].numel()) + 100 * rank + 1000 * group)
    group = dist.new_group(backend="gloo")
    expected = [torch.empty_like(flat) for flat in flats]
    for whole, parts in zip(expected, partitions):
        dist.all_gather_into_tensor(whole, parts[rank].clone())
    pieces = []
    all_gather = dist.all_gather
    dist.all_gather = lambda *args, **kwargs: pieces.append(args[1].numel()) or all_gather(*args, **kwargs)
    with gather.parameters_gathered_in_pieces(group):
        stage_1_and_2.all_gather_dp_groups(groups_flat=flats, partitioned_param_groups=partitions,
                                           dp_process_group=[group, group], start_alignment_factor=2,
                                           allgather_bucket_size=10**9)
    equal = [torch.equal(flat, whole) for flat, whole in zip(flats, expected)]
    return equal, pieces, stage_1_and_2.all_gather_dp_groups is own


def test_zero_parameters_are_gathered_in_pieces_over_gloo_with_the_same_result():
    assert run_local(gathered_in_pieces, 2) == [([True, True], [10, 10, 3, 5], True)] * 2

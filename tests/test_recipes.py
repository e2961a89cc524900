"""The Hydra recipes and `gradsync-train`: config groups compose, bad values are named, a real
2-rank job reports its breakdown, and a 2-job sweep writes its summary."""
import csv
import json
import logging
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from gradsync import ConfigError
from gradsync.recipes import app, data, models, schema
from gradsync.recipes.summary import collect, markdown

GROUPS = ("strategy", "model", "data", "trainer", "cluster", "logger", "hparams_search")

# the planner behind each registered gradsync strategy name (compressors are scheduled by optimal_merge)
PLANNERS = {"wfbp": "wfbp", "ddp_buckets": "ddp", "mg_wfbp": "mg_wfbp", "optimal_merge": "optimal_merge",
            "asc_wfbp": "asc_wfbp", "bytescheduler": "bytescheduler", "us_byte": "us_byte", "gradsync_auto": "auto",
            "acp_sgd": "optimal_merge", "powersgd": "optimal_merge", "signsgd": "optimal_merge",
            "topk": "optimal_merge", "fp16": "optimal_merge", "bf16": "optimal_merge", "minmax8": "optimal_merge",
            "forest": "auto"}


def options(group):
    """The group's options as Hydra sees them (package files and the ConfigStore)."""
    with initialize_config_module("gradsync.recipes.conf", version_base="1.3"):
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


def composed(*overrides):
    with initialize_config_module("gradsync.recipes.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_every_strategy_is_a_config_option_and_nothing_else():
    assert options("strategy") == sorted(["ddp", *PLANNERS])
    from pytorch_lightning.strategies import StrategyRegistry

    from gradsync.strategies import GradSyncStrategy

    registered = [name for name, entry in StrategyRegistry.items() if issubclass(entry["strategy"], GradSyncStrategy)]
    assert sorted(["ddp", *registered]) == sorted(["ddp", *PLANNERS])


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_a_group_composes_and_passes_the_checks(group):
    fitting = {"transformer": ["data=synthetic_tokens"], "synthetic_tokens": ["model=transformer"]}
    for option in options(group):
        cfg = composed(f"{group}={option}", *fitting.get(option, []))
        if group in ("strategy", "model", "data"):
            assert schema.job_labels(cfg)[group] == option
        if group == "logger":
            assert cfg.logger.kind == option
        if group == "cluster" and cfg.cluster.accelerator == "gpu":  # gpu, slurm
            assert cfg.cluster.backend == "nccl"
            continue  # checked below: needs CUDA devices
        schema.check(cfg)


def test_the_optuna_recipe_tunes_partition_size_channels_and_rank():
    with initialize_config_module("gradsync.recipes.conf", version_base="1.3"):
        cfg = compose("config", overrides=["hparams_search=optuna", "strategy.options.credit=3"],
                      return_hydra_config=True)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper")
    assert set(cfg.hydra.sweeper.params) == {"strategy.options.partition_bytes", "strategy.options.credit",
                                             "strategy.compressor.rank"}
    assert list(cfg.hydra.sweeper.direction) == ["maximize", "maximize"] and len(cfg.objectives) == 2
    assert cfg.strategy.options.channels == 3  # one process group per credit slot
    result = {"accuracy": [50.0, 90.0], "breakdown": {"throughput": 6400.0, "iteration_ms": 10.0}}
    assert app.objective_values(result, cfg.objectives) == [6400.0, 90.0]
    assert app.objective_values(result, ["iteration_ms"]) == 10.0


def test_the_optuna_recipe_samples_credits_1_to_3():
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    with initialize_config_module("gradsync.recipes.conf", version_base="1.3"):
        cfg = compose("config", overrides=["hparams_search=optuna"], return_hydra_config=True)
    # as the sweeper reads its params (OptunaSweeperImpl._parse_sweeper_params_config)
    space, _ = create_params_from_overrides([f"{key}={value}" for key, value in cfg.hydra.sweeper.params.items()])
    credit = space["strategy.options.credit"]
    values = credit.choices if hasattr(credit, "choices") else range(credit.low, credit.high + 1, credit.step)
    assert sorted(values) == [1, 2, 3]


def test_an_optuna_sweep_runs_its_trials_and_writes_the_summary(tmp_path, monkeypatch):
    sweep = tmp_path / "optuna"
    run_app(monkeypatch, "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2",
            "hydra.sweeper.sampler.population_size=2", "trainer=quick", "timeline=false", f"hydra.sweep.dir={sweep}")
    with (sweep / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 and all(row["strategy"] == "bytescheduler+acp_sgd" for row in rows)
    assert all(float(row["throughput"]) > 0 and 0 <= float(row["final_accuracy"]) <= 100 for row in rows)
    tried = [json.loads((sweep / row["job"] / "result.json").read_text())["overrides"] for row in rows]
    assert all(any(o.startswith("strategy.options.partition_bytes=") for o in overrides) for overrides in tried)


def test_the_sweeper_directions_must_match_the_objectives():
    with initialize_config_module("gradsync.recipes.conf", version_base="1.3"):
        optuna = compose("config", overrides=["hparams_search=optuna", "objectives=[throughput]"],
                         return_hydra_config=True)
        basic = compose("config", return_hydra_config=True)
    directions = app.sweeper_directions(optuna.hydra.sweeper)
    assert directions == ["maximize", "maximize"] and app.sweeper_directions(basic.hydra.sweeper) is None
    with pytest.raises(ConfigError, match=r"^objectives: 1 given \(throughput\) but the sweeper optimises 2"):
        schema.check(optuna, directions)
    schema.check(optuna)  # a single run returns its one objective to no sweeper


def test_an_optuna_sweep_with_too_few_objectives_starts_no_trial(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(app, "run_local", lambda *args, **kwargs: pytest.fail("a trial started"))
    with pytest.raises(SystemExit):
        run_app(monkeypatch, "-m", "hparams_search=optuna", "objectives=[throughput]", "hydra.sweeper.n_trials=1",
                f"hydra.sweep.dir={tmp_path}")
    assert "gradsync-train: error: objectives: 1 given" in capsys.readouterr().err


def test_every_model_and_data_set_has_a_kind():
    assert set(schema.MODEL_INPUTS) == set(models.MODELS) and set(schema.DATA_KINDS) == set(data.DATASETS)
    assert options("model") == sorted(models.MODELS) and options("data") == sorted(data.DATASETS)


def test_the_model_options_follow_the_data():
    cfg = composed("model=mlp", "data=synthetic_images")
    assert cfg.model.network.inputs == 16 * 16 and cfg.model.network.classes == 10
    network = schema.instantiate(cfg.model.network, "model.network")
    assert network[1].in_features == 256
    assert composed("model=transformer", "data=synthetic_tokens").model.network.vocab == 256
    assert composed().trainer.devices == 2 == composed("trainer.devices=2").cluster.devices


def test_the_synthetic_data_takes_its_classes_and_vocab_from_the_data_config():
    cfg = composed("data=synthetic_tokens", "model=transformer", "data.classes=20", "data.vocab=1000")
    schema.check(cfg)
    split = schema.instantiate(cfg.data, "data").split
    tokens, labels = split.train.dataset.tensors
    assert (split.classes, split.vocab, int(labels.max()), cfg.model.network.vocab) == (20, 1000, 19, 1000)
    assert int(tokens.max()) > 256


def test_every_rank_gets_as_many_training_batches():
    # 1437 training samples over 4 ranks: the 1437th is left out, as DistributedSampler(drop_last=True) does
    shards = [data.load("digits", rank=rank, world_size=4, batch_size=8) for rank in range(4)]
    assert [len(shard.train.dataset) for shard in shards] == [359] * 4
    assert [len(shard.train) for shard in shards] == [359 // 8] * 4


def test_the_limits_themselves_pass_the_checks():
    schema.check(composed("data.batch_size=718", "seed=4294967295", "cluster.timeout=1e300"))
    schema.check(composed("strategy=forest", "trainer.devices=2"))


def test_each_strategy_option_builds_its_lightning_strategy():
    from pytorch_lightning.strategies import DDPStrategy

    from gradsync.strategies import GradSyncStrategy

    for option in options("strategy"):
        job = OmegaConf.to_container(composed(f"strategy={option}"), resolve=True)
        strategy = app.build_strategy(job)
        assert isinstance(strategy, DDPStrategy) and strategy.process_group_backend == "gloo"
        if option == "ddp":
            assert not isinstance(strategy, GradSyncStrategy)
            continue
        assert strategy.scheduler == PLANNERS[option]
        assert strategy.gradsync_options.get("transport", "allreduce") == ("forest" if option == "forest" else "allreduce")
    chosen = composed("strategy.compressor.rank=2", "strategy.scheduler=wfbp")
    acp = app.build_strategy(OmegaConf.to_container(chosen, resolve=True))
    assert acp.compressor == {"type": "acp_sgd", "rank": 2, "min_compression_rate": 2.0, "start_iter": 0,
                              "error_feedback": True, "reuse": True, "seed": None, "wire_dtype": None} and acp.scheduler == "wfbp"


@pytest.mark.parametrize("override", ["+strategy.compressor={type:acp_sgd,rank:2}",
                                      "strategy.compressor={type:acp_sgd,rank:2}",
                                      "+strategy.compressor.type=acp_sgd +strategy.compressor.rank=2"])
def test_a_compressor_can_be_added_to_a_scheduler_strategy(override):
    cfg = composed("strategy=us_byte", *override.split())
    schema.check(cfg)
    strategy = app.build_strategy(OmegaConf.to_container(cfg, resolve=True))
    assert strategy.compressor == {"type": "acp_sgd", "rank": 2} and strategy.scheduler == "us_byte"


def test_the_compressor_group_adds_any_compressor_with_its_defaults():
    from gradsync import compress

    assert options("strategy/compressor") == sorted(spec.name for spec in compress.registry if spec.strategy)
    cfg = composed("strategy=us_byte", "+strategy/compressor=powersgd", "strategy.compressor.rank=2")
    schema.check(cfg)
    strategy = app.build_strategy(OmegaConf.to_container(cfg, resolve=True))
    assert strategy.compressor == {"type": "powersgd", "rank": 2, "min_compression_rate": 2.0, "start_iter": 0,
                                   "error_feedback": True, "warm_start": True, "wire_dtype": None}
    assert strategy.scheduler == "us_byte"


@pytest.mark.parametrize("override, key", [("+cluster.nodes=2", "cluster.nodes"), ("+foo=1", "foo"),
                                           ("+cluster.gpus=2", "cluster.gpus")])
def test_a_key_that_nothing_reads_is_refused_naming_it(override, key):
    with pytest.raises(ConfigError, match=f"^{key}: gradsync-train reads no such key; the keys"):
        schema.check(composed(override))


@pytest.mark.parametrize("override, target, valid", [
    ("+trainer.precison=16", "pytorch_lightning.Trainer", "precision"),
    ("+model.bogus=1", "gradsync.recipes.lightning_module.Classifier", "lr, momentum, network"),
    ("+model.network.bogus=1", "gradsync.recipes.models.small_cnn", "channels, classes"),
    ("+data.bogus=1", "gradsync.recipes.lightning_module.ShardedData", "batch_size"),
    ("+data.dataset.bogus=1", "gradsync.recipes.data.digits", "test_fraction"),
])
def test_a_key_its_target_does_not_take_is_refused_naming_the_arguments(override, target, valid):
    key = override[1:].split("=")[0]
    with pytest.raises(ConfigError) as error:
        schema.check(composed(override))
    assert str(error.value).startswith(f"{key}: unknown argument of {target} '{key.rsplit('.', 1)[-1]}'; valid: ")
    assert valid in str(error.value)


def test_any_trainer_argument_is_passed_to_lightnings_trainer():
    cfg = composed("+trainer.precision=bf16-mixed", "+trainer.accumulate_grad_batches=2",
                   "+trainer.gradient_clip_val=0.5", "trainer.max_epochs=2")
    schema.check(cfg)
    trainer = schema.instantiate(cfg.trainer, "trainer", accelerator="cpu", devices=1, logger=False)
    assert (trainer.precision, trainer.accumulate_grad_batches, trainer.gradient_clip_val, trainer.max_epochs) == (
        "bf16-mixed", 2, 0.5, 2)


def test_free_form_options_take_any_key_for_what_reads_them_to_check():
    schema.check(composed("strategy=us_byte", "+strategy.options.partition_bytes=4000000"))
    typo = composed("strategy=us_byte", "+strategy.options.partition_byte=4000000")
    schema.check(typo)
    with pytest.raises(ConfigError, match="unknown option.*partition_byte"):  # the strategy checks its options
        app.build_strategy(OmegaConf.to_container(typo, resolve=True))


def test_a_compressor_key_not_in_the_config_needs_hydras_plus():
    with pytest.raises(ConfigCompositionException, match=r"use \+strategy\.compressor\.type=acp_sgd"):
        composed("strategy=us_byte", "strategy.compressor.type=acp_sgd")


def test_cluster_gpu_needs_cuda_devices():
    import torch

    cfg = composed("cluster=gpu", "trainer.devices=64")
    with pytest.raises(ConfigError, match="trainer.devices|cluster.accelerator") as error:
        schema.check(cfg)
    assert ("valid: 1.." in str(error.value)) == (torch.cuda.device_count() > 0)


@pytest.mark.parametrize("override, key, choices", [
    ("strategy.compressor.rank=-1", "strategy.compressor", ["'rank'", ">= 1"]),
    ("strategy._target_=bogus.Strategy", "strategy._target_", ["cannot import", "'bogus.Strategy'"]),
    ("strategy.scheduler=bogus", "strategy.scheduler", ["mg_wfbp", "auto"]),
    ("strategy.compressor.type=bogus", "strategy.compressor.type", ["powersgd", "topk"]),
    ("strategy=us_byte +strategy.compressor.type=bogus", "strategy.compressor.type", ["acp_sgd", "topk"]),
    ("strategy=us_byte +strategy.compressor={rank:2}", "strategy.compressor", ["'type'", "acp_sgd"]),
    ("strategy=us_byte +strategy.compressor={type:acp_sgd,bogus:1}", "strategy.compressor", ["'bogus'"]),
    ("strategy=us_byte strategy.compressor=acp_sgd", "strategy.compressor", ["mapping", "'acp_sgd'", "powersgd"]),
    ("+strategy.options.process_group_backend=mpi", "strategy.options.process_group_backend",
     ["cluster.backend", "gloo, nccl"]),
    ("+strategy.process_group_backend=mpi", "strategy.process_group_backend", ["cluster.backend", "gloo, nccl"]),
    ("strategy=ddp +strategy.scheduler=wfbp", "strategy.scheduler", ["Lightning's 'ddp'"]),
    ("model=transformer", "data", ["synthetic_tokens"]),
    ("logger.kind=bogus", "logger.kind", ["wandb", "csv", "none"]),
    ("cluster.backend=nccl", "cluster.backend", ["gloo"]),
    ("model.lr=0", "model.lr", ["> 0"]),
    ("model.lr=inf", "model.lr", ["finite", "inf"]),
    ("model.momentum=1", "model.momentum", ["[0, 1)"]),
    ("seed=-1", "seed", ["0..4294967295"]),
    ("seed=4294967296", "seed", ["0..4294967295"]),
    ("trainer.max_epochs=0", "trainer.max_epochs", [">= 1"]),
    ("trainer.num_nodes=2", "trainer.num_nodes", ["'local'", "cluster=torchrun", "cluster=slurm"]),
    ("cluster.launcher=bogus", "cluster.launcher", ["external", "local"]),
    ("+trainer.strategy=ddp", "trainer.strategy", ["gives pytorch_lightning.Trainer", "strategy=<name>"]),
    ("+trainer.accelerator=gpu", "trainer.accelerator", ["cluster.accelerator"]),
    ("+trainer.callbacks=[]", "trainer.callbacks", ["the recipe's callbacks"]),
    ("+data.seed=3", "data.seed", ["top-level seed"]),
    ("+data.dataset.batch_size=3", "data.dataset.batch_size", ["data.batch_size"]),
    ("model.network._target_=torch.nn.Nope", "model.network._target_", ["cannot import", "'torch.nn.Nope'"]),
    ("cluster.timeout=inf", "cluster.timeout", ["finite", "inf"]),
    ("cluster.timeout=1e400", "cluster.timeout", ["finite", "inf"]),
    ("data.batch_size=719", "data.batch_size", ["719", "718 training samples", "2 ranks"]),
    ("trainer.devices=4 data.batch_size=360", "data.batch_size", ["359 training samples", "4 ranks"]),
    ("data.classes=5", "data.classes", ["has classes 10", "5"]),
    ("data.classes=20", "data.classes", ["has classes 10", "20"]),
    ("model=mlp data.features=10", "data.features", ["has features 64", "10"]),
    ("data.vocab=5", "data.vocab", ["has vocab None", "5"]),
    ("data=synthetic_tokens model=transformer data.vocab=5", "data.dataset", ["'vocab'", "'classes' (10)", "5"]),
    ("data=synthetic_images data.dataset.size=8", "data.features", ["has features 64", "256"]),
    ("data=synthetic_images data.dataset.samples=0", "data.dataset.samples", [">= 1", "0"]),
    ("data=synthetic_images data.dataset.samples=1", "data.dataset", ["0 training", "2 ranks"]),
    ("+data.dataset.test_fraction=1.5", "data.dataset", ["'test_fraction'", "(0, 1)", "1.5"]),
    ("model=mlp +model.network.hidden=0", "model.network.hidden", [">= 1", "0"]),
    ("model.network.classes=5", "model.network.classes", ["has classes 10", "5"]),
    ("model=mlp model.network.inputs=10", "model.network.inputs", ["has features 64", "10"]),
    ("data=synthetic_tokens model=transformer model.network.vocab=5", "model.network.vocab", ["has vocab 256"]),
    ("data=synthetic_tokens model=transformer +model.network.heads=3", "model.network", ["'heads'", "3"]),
    ("+model.network.channels=3", "model.network", ["cannot read", "[1, 8, 8]"]),
    ("objectives=[]", "objectives", ["final_accuracy", "throughput"]),
    ("strategy=forest trainer.devices=1", "trainer.devices", ["forest", "2 or more ranks", "1"]),
    ("strategy=forest +strategy.options.topology=ring-3", "trainer.devices", ["2 ranks", "3 workers"]),
])
def test_a_bad_value_names_the_key_and_the_valid_choices(override, key, choices):
    with pytest.raises(ConfigError) as error:
        schema.check(composed(*override.split()))
    message = str(error.value)
    assert message.startswith(key)
    assert all(choice in message for choice in choices), message


def test_a_wrong_type_or_unknown_option_fails_while_composing():
    with pytest.raises(ConfigCompositionException) as error:
        composed("trainer.max_epochs=abc")
    assert "trainer.max_epochs" in str(error.value.__cause__) and "Integer" in str(error.value.__cause__)
    with pytest.raises(MissingConfigException) as error:
        composed("strategy=bogus")
    assert all(name in str(error.value) for name in ("us_byte", "acp_sgd", "ddp", "gradsync_auto"))


def run_app(monkeypatch, *argv):
    """`gradsync-train *argv` in this process (Hydra's logging off). Hydra's logging configuration
    disables every logger that exists and the app sets some levels: both are put back afterwards,
    for the tests that run next in this process."""
    monkeypatch.setattr(sys, "argv", ["gradsync-train", *argv, "hydra/job_logging=disabled",
                                      "hydra/hydra_logging=disabled"])
    loggers = [logging.root, *(logger for logger in logging.root.manager.loggerDict.values()
                               if isinstance(logger, logging.Logger))]
    saved = [(logger, logger.disabled, logger.level, list(logger.handlers)) for logger in loggers]
    try:
        app.main()
    finally:
        for logger, disabled, level, handlers in saved:
            logger.disabled, logger.handlers = disabled, handlers
            logger.setLevel(level)


def test_the_app_reports_a_bad_value_without_a_traceback(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_app(monkeypatch, "strategy.compressor.rank=-1", f"hydra.run.dir={tmp_path}")
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "gradsync-train: error: strategy.compressor: " in error and "'rank'" in error
    assert "Traceback" not in error


def test_the_app_reports_ranks_that_time_out_without_a_traceback(tmp_path, monkeypatch, capsys):
    def late(*args, **kwargs):
        raise TimeoutError("ranks [1] did not report within 5 s")

    monkeypatch.setattr(app, "run_local", late)
    with pytest.raises(SystemExit) as exit_:
        run_app(monkeypatch, "cluster.timeout=5", f"hydra.run.dir={tmp_path}")
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "gradsync-train: error: ranks [1] did not report within 5 s" in error and "Traceback" not in error


def acp_sgd_wire_fraction(network, ops, rank=4, min_compression_rate=2.0):
    """ACP-SGD's mean wire size over a P step and a Q step, as a fraction of the gradient
    (acp-sgd §IV: an n×m matrix sends n·r then m·r values when (n + m)·r·rate < n·m; the rest
    travels whole), plus the runtime's flags: one "used" flag per tensor and step, and one
    "non-finite" flag per op (`ops`: the op count of the P and the Q plan)."""
    whole = p_step = q_step = 0
    for parameter in network.parameters():
        n = parameter.shape[0]
        m = parameter.numel() // n
        whole += parameter.numel()
        if parameter.dim() > 1 and (n + m) * rank * min_compression_rate < n * m:
            p_step, q_step = p_step + n * rank + 1, q_step + m * rank + 1
        else:
            p_step, q_step = p_step + parameter.numel() + 1, q_step + parameter.numel() + 1
    return (p_step + ops["P"] + q_step + ops["Q"]) / 2 / whole


def test_one_real_two_rank_job(tmp_path):
    cfg = composed("strategy=wfbp", "model=cnn", "data=digits", "trainer=quick", "logger=csv")
    result = app.train(cfg, tmp_path)
    assert result["ranks"] == 2 and result["strategy"] == "wfbp" and len(result["accuracy"]) == 1
    assert 0.0 <= result["accuracy"][0] <= 100.0
    breakdown = result["breakdown"]
    assert breakdown["steps"] == 8 - (1 + 3)  # max_steps minus the calibration (1 warm-up + 3 timed)
    tensors = list(models.build("cnn").parameters())
    gradient = sum(t.numel() for t in tensors)
    # no compressor: every gradient element travels once, plus two flags per op of one tensor each
    # ("used" and "non-finite")
    assert breakdown["compression_ratio"] == pytest.approx((gradient + 2 * len(tensors)) / gradient, rel=1e-12)
    assert breakdown["throughput"] == pytest.approx(2 * 32 / (breakdown["iteration_ms"] / 1e3))
    assert breakdown["predicted_ms"] > 0 and breakdown["comm_wait_ms"] >= 0
    assert result["plans"]["plain"] == {**result["plans"]["plain"], "planner": "wfbp", "ops": len(tensors)}
    assert Path(result["timeline"]).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "result.json").is_file()
    metrics = next(tmp_path.glob("csv/version_*/metrics.csv")).read_text().splitlines()[0].split(",")
    assert {"train/loss", "test/accuracy", "gradsync/iteration_time", "gradsync/comm_wait"} <= set(metrics)


def test_trainer_arguments_reach_lightnings_trainer_in_the_ranks(tmp_path, monkeypatch):
    run_app(monkeypatch, "strategy=wfbp", "trainer=quick", "logger=none", "timeline=false",
            "+trainer.accumulate_grad_batches=2", "+trainer.gradient_clip_val=0.5", f"hydra.run.dir={tmp_path}")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["trainer_arguments"] == {**result["trainer_arguments"], "accumulate_grad_batches": 2,
                                           "gradient_clip_val": 0.5, "max_steps": 8, "num_nodes": 1}


def test_a_two_job_sweep_writes_its_summary(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    run_app(monkeypatch, "-m", "strategy=ddp,acp_sgd", "trainer=quick", "logger=none", "timeline=false",
            f"hydra.sweep.dir={sweep}")
    with (sweep / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["job"], row["label"], row["strategy"]) for row in rows] == [
        ("0", "strategy=ddp", "ddp"), ("1", "strategy=acp_sgd", "acp_sgd")]
    ddp, acp = rows
    assert ddp["compression_ratio"] == "" and ddp["comm_wait_ms"] == "" and ddp["codec_ms"] == ""
    assert 0 < float(acp["codec_ms"]) < float(acp["iteration_ms"])
    plans = json.loads((sweep / "1" / "result.json").read_text())["plans"]
    expected = acp_sgd_wire_fraction(models.build("cnn"), {layout: plan["ops"] for layout, plan in plans.items()})
    assert float(acp["compression_ratio"]) == pytest.approx(expected, rel=1e-9)
    assert all(float(row["iteration_ms"]) > 0 and 0 <= float(row["final_accuracy"]) <= 100 for row in rows)
    table = (sweep / "summary.md").read_text().strip().splitlines()
    assert len(table) == 2 + 2 and "| 0 | strategy=ddp |" in table[2] and "n/a" in table[2]
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"


def test_the_summary_labels_jobs_by_what_differs(tmp_path):
    breakdown = {"steps": 4, "iteration_ms": 10.0, "throughput": 6400.0, "measured_ms": None, "predicted_ms": None,
                 "comm_wait_ms": None, "codec_ms": None, "compression_ratio": None}
    for job, strategy in ((10, "ddp"), (2, "wfbp")):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "result.json").write_text(json.dumps({
            "strategy": strategy, "model": "cnn", "data": "digits", "ranks": 2, "accuracy": [50.0, 75.5],
            "breakdown": breakdown, "overrides": [f"strategy={strategy}", "trainer=quick"]}))
    rows = collect(tmp_path)
    assert [(row["job"], row["label"], row["final_accuracy"]) for row in rows] == [
        ("2", "strategy=wfbp", 75.5), ("10", "strategy=ddp", 75.5)]
    assert markdown(rows).splitlines()[2] == "| 2 | strategy=wfbp | 10.00 | 6400 | 75.50 | n/a | n/a | n/a | n/a |"


def test_the_breakdown_takes_medians_of_the_forward_to_step_times_and_the_mean_of_bytes():
    from types import SimpleNamespace

    from gradsync.recipes.lightning_module import IterationTimer
    from gradsync.runtime.statistics import IterationStats

    # four steady iterations of a P/Q codec cycle, each with 3 ms between steps (not the model's
    # forward to step: its busy time plus the communication wait); the third spans an evaluation
    history = [IterationStats(i, busy + wait + between, wait, sent, predicted, busy_time=busy, codec_time=codec)
               for i, (busy, wait, between, sent, predicted, codec) in enumerate(
                   [(0.006, 0.001, 0.003, 100, 0.009, 0.001), (0.007, 0.002, 0.003, 300, 0.011, 0.004),
                    (0.006, 0.003, 0.491, 100, 0.009, 0.002), (0.007, 0.002, 0.003, 300, 0.011, 0.005)])]
    timer = IterationTimer(runtime_of=lambda trainer: None)
    timer.step_times, timer.steady_step, timer.steady_iteration = [0.010, 0.012, 0.500, 0.011], 0, 0
    timer.runtime = SimpleNamespace(report=lambda: SimpleNamespace(history=tuple(history), gradient_bytes=1000))
    breakdown = timer.breakdown(samples_per_step=64)
    assert breakdown["measured_ms"] == pytest.approx(9.0) and breakdown["iteration_ms"] == pytest.approx(11.5)
    assert breakdown["predicted_ms"] == pytest.approx(10.0) and breakdown["comm_wait_ms"] == pytest.approx(2.0)
    assert breakdown["codec_ms"] == pytest.approx(3.0)
    assert breakdown["compression_ratio"] == pytest.approx(0.2)

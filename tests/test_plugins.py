"""A planner from a package outside gradsync (tests/plugins/gradsync_example_plugin.py), added by
`planners.register` or by its distribution's entry point, reaches every door: `gradsync.wrap`,
`Trainer(strategy=<name>)`, the DeepSpeed section, Hydra's `strategy=<name>` and `gradsync plan`.
The registries refuse what they cannot take."""
import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync import ConfigError, compress, planners
from gradsync.compress import CodecSpec
from gradsync.launch import run_local
from gradsync.planners import PlannerSpec
from gradsync.profile import zoo
from gradsync.runtime import attached
from runtime_models import TiedNet, distance, train_side_by_side

PLUGINS = Path(__file__).with_name("plugins")


def _example_plugin():
    """The example plugin module, loaded from its file: its folder stays off sys.path, or its
    entry point would register the planner in every process started from here."""
    found = importlib.util.spec_from_file_location("gradsync_example_plugin", PLUGINS / "gradsync_example_plugin.py")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


gradsync_example_plugin = _example_plugin()

NAME = "layer_groups"


def with_plugin_installed() -> dict:
    """The environment of a process that has the example distribution on its path: its entry
    point registers the planner at `import gradsync`, with nothing else done."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}


def register_plugin() -> None:
    if NAME not in planners.names():
        planners.register(gradsync_example_plugin.SPEC)


def test_the_entry_point_registers_the_planner_and_its_lightning_strategy_at_import():
    script = ("import gradsync; from gradsync import planners; "
              "from pytorch_lightning.strategies import StrategyRegistry as R; "
              f"print(planners.names()[-1], R[{NAME!r}]['init_params'], R[{NAME!r}]['description'])")
    done = subprocess.run([sys.executable, "-c", script], env=with_plugin_installed(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (f"{NAME} {{'scheduler': {NAME!r}}} "
                                   "gradsync: a fixed number of layers per all-reduce, output side first")


def test_gradsync_plan_uses_an_installed_planner():
    done = subprocess.run([sys.executable, "-m", "gradsync.cli", "plan", "--model", "resnet50", "--cluster",
                           "asc-wfbp-10gbe", "--scheduler", NAME, "-o", "layers_per_op=4", "--json"],
                          env=with_plugin_installed(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)["plans"]["plain"]
    layers = sum(1 for layer in zoo("resnet50").layers if layer.tensors)
    assert (plan["planner"], plan["options"]) == (NAME, {"layers_per_op": 4})
    assert len(plan["ops"]) == math.ceil(layers / 4)


def plugin_trains_like_ddp(rank, world_size):
    """gradsync.wrap with the plugin planner (registered in this rank) beside torch DDP, 8 steps."""
    register_plugin()
    torch.manual_seed(0)
    model = TiedNet()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=NAME,
                                     layers_per_op=3, warmup_iterations=0, measure_iterations=1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    train_side_by_side(((model, optimizer), (reference, ref_optimizer)), rank, 8)
    optimizer.synchronize()
    sync = attached(model)
    layers = sum(1 for layer in sync.installed.profile.layers if layer.tensors)
    result = (distance(model, reference), sync.plan.planner, sync.plan.options, len(sync.plan.ops), layers)
    sync.detach()
    return result


def test_wrap_runs_a_registered_planner_like_ddp():
    for difference, planner, options, ops, layers in run_local(plugin_trains_like_ddp, 2):
        assert difference < 1e-5
        assert (planner, options, ops) == (NAME, {"layers_per_op": 3}, math.ceil(layers / 3)) and layers > 3


def lightning_runs(rank, world_size, root):
    """Lightning's `ddp` and the plugin's registered strategy name on the same data."""
    import pytorch_lightning as pl

    register_plugin()
    os.environ["LOCAL_RANK"] = str(rank)
    records = {}
    for strategy in ("ddp", NAME):
        pl.seed_everything(0, verbose=False)
        model = LightningNet()
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=4, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=root)
        trainer.fit(model, loader())
        records[strategy] = ([p.detach().clone() for p in model.parameters()],
                             getattr(trainer.strategy, "scheduler", None))
    return (max((a - b).abs().max().item() for a, b in zip(records["ddp"][0], records[NAME][0])), records[NAME][1])


def loader():
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=generator),
                                          torch.randint(0, 4, (64,), generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _lightning_net():
    import pytorch_lightning as pl

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                           torch.nn.Tanh(), torch.nn.Linear(32, 4))

        def training_step(self, batch, _index):
            inputs, targets = batch
            return F.cross_entropy(self.net(inputs), targets)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Net


LightningNet = _lightning_net()


def test_trainer_takes_the_registered_name(tmp_path):
    for difference, scheduler in run_local(lightning_runs, 2, str(tmp_path), timeout=240):
        assert scheduler == NAME and difference < 1e-5


def in_a_fresh_process(fn):
    """`fn()` in a rank process of its own: what it registers stays out of this test process."""
    return run_local(lambda_free_call, 1, fn, timeout=180)[0]


def lambda_free_call(rank, world_size, fn):
    return fn()


def deepspeed_section_checks():
    """The checked arguments of a DeepSpeed section naming the plugin (DeepSpeed's engine and
    gradsync's attach stubbed), and the error for a bad option."""
    import deepspeed

    import gradsync.deepspeed
    from test_deepspeed import bare_engine, stub_engine_constructor

    register_plugin()
    checked = []
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "gradsync": {"scheduler": NAME, "options": {"layers_per_op": 5}}}
    with pytest.MonkeyPatch.context() as patch:
        stub_engine_constructor(patch, bare_engine)
        patch.setattr(gradsync.deepspeed.engine, "attach", lambda engine, arguments: checked.append(arguments))
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        config["gradsync"]["options"] = {"layers_per_op": 0}
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        except ConfigError as exc:
            return checked[0].planner.name, dict(checked[0].planner.options), str(exc)


def test_the_deepspeed_section_takes_the_registered_planner():
    pytest.importorskip("deepspeed")
    name, options, refusal = in_a_fresh_process(deepspeed_section_checks)
    assert (name, options) == (NAME, {"layers_per_op": 5})
    assert "DeepSpeed config 'gradsync." in refusal and "'layers_per_op' must be an integer >= 1, got 0" in refusal


def hydra_strategy():
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from gradsync.recipes import app, schema

    register_plugin()
    with initialize_config_module("gradsync.recipes.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"strategy={NAME}", "+strategy.options.layers_per_op=4"])
    schema.check(cfg)
    strategy = app.build_strategy(OmegaConf.to_container(cfg, resolve=True))
    return strategy.scheduler, strategy.gradsync_options


def test_hydra_offers_the_registered_name_as_a_strategy():
    assert in_a_fresh_process(hydra_strategy) == (NAME, {"layers_per_op": 4})


def registered_compressor():
    from hydra import compose, initialize_config_module
    from pytorch_lightning.strategies import StrategyRegistry

    from gradsync.compress.signsgd import SignSGD

    class Signs(SignSGD):
        name = "plugin_signs"

    compress.register(CodecSpec(Signs, "signs under another name"))
    with initialize_config_module("gradsync.recipes.conf", version_base="1.3"):
        cfg = compose("config", overrides=["strategy=plugin_signs"])
    return (compress.build({"type": "plugin_signs", "majority_vote": True}).majority_vote,
            StrategyRegistry["plugin_signs"]["init_params"], dict(cfg.strategy.compressor))


def test_a_registered_compressor_is_a_strategy_and_a_hydra_option():
    votes, init_params, config = in_a_fresh_process(registered_compressor)
    assert votes and init_params == {"scheduler": "optimal_merge", "compressor": "plugin_signs"}
    assert config == {"type": "plugin_signs", "error_feedback": True, "majority_vote": False}


@pytest.mark.parametrize("register, message", [
    (lambda: planners.register(PlannerSpec("wfbp", lambda profile, cost: None, "again")), "already registered"),
    (lambda: planners.register(PlannerSpec("two words", lambda profile, cost: None, "bad")), "identifier"),
    (lambda: planners.register("wfbp"), "PlannerSpec"),
    (lambda: compress.register(CodecSpec(int, "not a codec")), "Codec subclass"),
])
def test_registries_refuse_duplicates_and_what_is_not_a_spec(register, message):
    with pytest.raises(ConfigError, match=message):
        register()


def test_a_planner_named_like_a_lightning_strategy_needs_another_strategy_name():
    def plan(profile, cost, *, overlap_forward):
        raise AssertionError("never planned")

    with pytest.raises(ConfigError, match="'ddp' is Lightning's own DDPStrategy"):
        planners.register(PlannerSpec("ddp_clash", plan, "clashes", strategy="ddp"))
    assert "ddp_clash" not in planners.names()


def test_the_readmes_tables_are_the_registries():
    from gradsync.listing import stale_tables

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert stale_tables(readme) == [], "run: python -m gradsync.listing README.md"


def test_listing_rewrites_a_stale_table_and_gradsync_list_shows_installed_planners(tmp_path):
    from gradsync.listing import TABLES, rewrite, stale_tables

    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- begin generated: schedulers -->\nold\n<!-- end generated: schedulers -->\n"
                      "<!-- begin generated: compressors -->\n<!-- end generated: compressors -->\noutro\n")
    assert stale_tables(readme.read_text()) == ["schedulers", "compressors"]
    rewrite(readme)
    assert stale_tables(readme.read_text()) == []
    assert readme.read_text().startswith("intro\n") and readme.read_text().endswith("outro\n")
    assert "| `us_byte` | `us_byte` | US-Byte" in TABLES["schedulers"]()
    done = subprocess.run([sys.executable, "-m", "gradsync.cli", "list"], env=with_plugin_installed(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (f"| `{NAME}` | `{NAME}` | a fixed number of layers per all-reduce, output side first | "
            "`layers_per_op` (2), `overlap_forward` (false) | — |") in done.stdout


def test_every_builtin_spec_cites_a_paper_of_the_bibliography():
    from gradsync.bibliography import PAPERS, cited

    sources = {spec.name: spec.source for registry in (planners.registry, compress.registry) for spec in registry
               if spec.source}
    assert {name: source for name, source in sources.items() if cited(source) is None} == {}
    assert {cited(source) for source in sources.values()} >= {"mg-wfbp", "asc-wfbp", "us-byte", "acp-sgd"}
    assert all(paper.link.startswith("https://") for paper in PAPERS.values())

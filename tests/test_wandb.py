"""An offline W&B run of a 2-rank job holds the config, the per-step metrics, the breakdown, the
plan as a table and the timeline image; read back with wandb's own reader of the .wandb log."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from gradsync.recipes import app, models
from gradsync.recipes.wandb_logging import PLAN_COLUMNS

STEPS = 8  # trainer=quick: max_steps 8, a log line every step


def records(run_dir: Path) -> list[dict]:
    """Every record of the run's transaction log, as `wandb leet inspect --json` prints them."""
    log = next(run_dir.glob("run-*.wandb"))
    wandb_cli = Path(sys.executable).with_name("wandb")
    done = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(log)], capture_output=True, text=True,
                          timeout=60, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("job")
    patch = pytest.MonkeyPatch()
    for variable in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        patch.setenv(variable, str(directory / "wandb-home"))  # keep the staging files out of $HOME
    with initialize_config_module("gradsync.recipes.conf", version_base="1.3"):
        cfg = compose("config", overrides=["strategy=mg_wfbp", "trainer=quick", "logger=wandb"])
    result = app.train(cfg, directory)
    patch.undo()
    return directory, result, records(Path(result["wandb_run"]))


def test_each_job_writes_exactly_one_finished_offline_run(offline_run):
    directory, result, log = offline_run
    runs = list((directory / "wandb").glob("offline-run-*"))
    assert [str(r) for r in runs] == [result["wandb_run"]]  # rank 1 opened none
    assert [r["exit"]["exit_code"] for r in log if r["type"] == "exit"] == [0]  # wandb.finish() ran


def test_the_run_holds_the_config_and_per_step_metrics(offline_run):
    _, _, log = offline_run
    config = {}
    for record in log:
        if record["type"] == "config":
            config.update(record["config"]["update"])
    assert config["strategy"]["scheduler"] == "mg_wfbp" and config["trainer"]["max_steps"] == STEPS
    # the job config and the module's hyperparameters
    assert config["model"]["network"]["_target_"] == "gradsync.recipes.models.small_cnn" and config["lr"] == 0.05
    history = [r["history"]["item"] for r in log if r["type"] == "history"]
    for metric in ("train/loss", "gradsync/iteration_time", "gradsync/comm_wait", "gradsync/codec_time",
                   "gradsync/compression_ratio"):
        assert sum(metric in row for row in history) == STEPS, metric
    assert sum("test/accuracy" in row for row in history) == 1


def test_the_run_holds_the_breakdown_the_plan_table_and_the_timeline(offline_run):
    _, result, log = offline_run
    run = Path(result["wandb_run"])
    summary = {}
    for record in log:
        if record["type"] == "summary":
            summary.update(record["summary"].get("update", {}))
    breakdown = result["breakdown"]
    for key in ("iteration_ms", "comm_wait_ms", "codec_ms", "predicted_ms", "measured_ms", "compression_ratio"):
        assert summary[f"breakdown/{key}"] == pytest.approx(breakdown[key], rel=1e-9)

    table = json.loads(next((run / "files" / "media" / "table").glob("plan_*.table.json")).read_text())
    assert table["columns"] == PLAN_COLUMNS
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert len(rows) == result["plans"]["plain"]["ops"]
    network = models.build("cnn")
    # without compression the ops carry the whole gradient (fp32), each op's bytes once
    assert sum(row["bytes"] for row in rows) == 4 * sum(p.numel() for p in network.parameters())
    names = {f"network.{name}" for name, _ in network.named_parameters()}
    assert {row["first_tensor"] for row in rows} | {row["last_tensor"] for row in rows} <= names
    assert all(row["predicted_start_ms"] <= row["predicted_end_ms"] for row in rows)
    image = next((run / "files" / "media" / "images").glob("timeline_*.png"))
    assert image.read_bytes()[:4] == b"\x89PNG"

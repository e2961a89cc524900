"""`gradsync-train` with ranks started by a launcher (cluster.launcher=external): torchrun on two
"nodes" of this machine and submitit's local tasks train exactly as the recipe's own launch does;
a process no launcher started, or ranks that do not match the config, are refused first."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_module

from gradsync import ConfigError
from gradsync.launch import ExternalRank, external_rank, free_port
from gradsync.recipes import app
from test_recipes import composed

JOB = ["strategy=wfbp", "trainer=quick", "trainer.max_steps=24", "logger=none", "timeline=false"]


@pytest.fixture(scope="module")
def local_job(tmp_path_factory):
    """The job with the recipe's own launch: 2 ranks on this node."""
    return app.train(composed(*JOB), tmp_path_factory.mktemp("local"))


def launched(command: list[str], cwd) -> subprocess.Popen:
    environment = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "HYDRA_FULL_ERROR": "1"}
    return subprocess.Popen(command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finished(processes: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    return outputs


def listening(port: int, timeout: float = 120) -> None:
    """Wait until something accepts connections on `port` of this machine."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on port {port}"
            time.sleep(0.2)


def same_training(result: dict, reference: dict) -> None:
    """The same ranks, steps and test accuracy (every prediction of the test set) as `reference`."""
    assert (result["ranks"], result["breakdown"]["steps"]) == (reference["ranks"], reference["breakdown"]["steps"])
    assert result["accuracy"] == reference["accuracy"]
    assert result["breakdown"]["compression_ratio"] == reference["breakdown"]["compression_ratio"]


def test_torchrun_on_two_nodes_of_one_rank_each_trains_as_the_local_launch(tmp_path, monkeypatch, local_job):
    port, run_dir = free_port(), tmp_path / "job"

    def node(rank: int) -> subprocess.Popen:
        return launched([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                         "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
                         "-m", "gradsync.recipes.app", "cluster=torchrun", "trainer.devices=1", "trainer.num_nodes=2",
                         *JOB, f"hydra.run.dir={run_dir}"], tmp_path)

    # two "nodes" share this machine's cores: one OpenMP thread each, as torchrun gives the ranks of a
    # node it starts several of (with its own count, the ranks' idle OpenMP threads spin on the cores)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = node(0)
    listening(port)  # node 1's agent would otherwise back off while node 0's store is not up yet
    outputs = finished([first, node(1)])
    result = json.loads((run_dir / "result.json").read_text())
    assert result["rank"] == 0 and result["trainer_arguments"]["num_nodes"] == 2
    same_training(result, local_job)
    assert "wfbp: cnn on digits, 2 ranks" in outputs[0] and "wfbp: cnn on digits" not in outputs[1]  # rank 0 reports


def test_submitit_tasks_train_as_the_local_launch(tmp_path, local_job):
    sweep = tmp_path / "sweep"
    output, = finished([launched([sys.executable, "-m", "gradsync.recipes.app", "-m", "cluster=slurm",
                                  "hydra/launcher=submitit_local", "hydra.launcher.gpus_per_node=null",
                                  "cluster.accelerator=cpu", "cluster.backend=gloo", "cluster.threads=1",
                                  "trainer.devices=2", *JOB, f"hydra.sweep.dir={sweep}"], tmp_path)])
    result = json.loads((sweep / "0" / "result.json").read_text())
    assert result["rank"] == 0
    same_training(result, local_job)
    assert "sweep summary:" in output and (sweep / "summary.csv").read_text().count("\n") == 2  # header, one job


def test_the_slurm_preset_asks_for_one_task_and_gpu_per_rank_on_every_node():
    with initialize_config_module("gradsync.recipes.conf", version_base="1.3"):
        cfg = compose("config", overrides=["cluster=slurm", "trainer.devices=8", "trainer.num_nodes=4"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and cfg.cluster.launcher == "external"
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node, launcher.cpus_per_task) == (4, 8, 8, 4)


def plain_environment(monkeypatch, **variables):
    """os.environ without any launcher's variables, plus `variables`."""
    launchers = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                 "MASTER_PORT")
    for name in {*launchers, *(key for key in os.environ if key.startswith("SUBMITIT")), "SUBMITIT_EXECUTOR"}:
        monkeypatch.setenv(name, "")  # restored to its value, or removed, after the test
        monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_external_launch_without_a_launcher_is_refused_naming_what_is_missing(tmp_path, monkeypatch):
    plain_environment(monkeypatch)
    with pytest.raises(ConfigError, match="not started by torchrun or submitit: RANK, WORLD_SIZE, LOCAL_RANK"):
        app.train(composed("cluster=torchrun", *JOB), tmp_path)


def test_ranks_a_launcher_started_must_match_devices_times_nodes(tmp_path, monkeypatch):
    import torch.distributed as dist

    plain_environment(monkeypatch, RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")
    with pytest.raises(ConfigError, match=r"^trainer.devices x trainer.num_nodes: 2 x 1 = 2 ranks, but the launcher "
                                          "started 3"):
        app.train(composed("cluster=torchrun", *JOB), tmp_path)
    assert not dist.is_initialized()


def test_the_place_of_a_rank_comes_from_torchrun_or_submitit(monkeypatch):
    plain_environment(monkeypatch, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", GROUP_RANK="2", MASTER_ADDR="h",
                      MASTER_PORT="2")
    assert external_rank() == ExternalRank(rank=5, world_size=8, local_rank=1, node_rank=2)
    plain_environment(monkeypatch, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
                      MASTER_ADDR="h", MASTER_PORT="2")
    assert external_rank().node_rank == 1  # no node variable: rank // ranks per node
    plain_environment(monkeypatch, SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_JOB_ID="77", SUBMITIT_LOCAL_NTASKS="4",
                      SUBMITIT_LOCAL_JOB_NUM_NODES="2", SUBMITIT_LOCAL_NODEID="1", SUBMITIT_LOCAL_GLOBALID="3",
                      SUBMITIT_LOCAL_LOCALID="1")
    assert external_rank() == ExternalRank(rank=3, world_size=4, local_rank=1, node_rank=1)
    assert os.environ["MASTER_ADDR"] and int(os.environ["MASTER_PORT"]) > 0

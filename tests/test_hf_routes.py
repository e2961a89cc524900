"""gradsync under Hugging Face's routes: Transformers' Trainer and Accelerate build DeepSpeed's
engine through `deepspeed.initialize`, where gradsync's entry reads the config's section, and
Accelerate's DistributedDataParallel takes gradsync's compression hook (tests/hf_deepspeed_job.py,
2 CPU ranks as under torchrun)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.launch import free_port

JOB = Path(__file__).with_name("hf_deepspeed_job.py")


@pytest.fixture(scope="module")
def hf_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_deepspeed_job")
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    ranks = [subprocess.Popen([sys.executable, str(JOB), str(out)],
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=240)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("run", ["trainer_zero0", "trainer_zero2", "accelerate_zero1"])
def test_a_section_in_the_config_trains_as_deepspeed_does(hf_job, run):
    """Trainer: ZeRO 0 (clipping at 2, which some steps reach) and 2, accumulation 2, its SGD;
    Accelerate: ZeRO 1, SGD with momentum; us_byte (updates deferred to the next forward) against
    DeepSpeed's own run."""
    result = hf_job[run]
    assert result["world_size"] == 2
    assert result["engines"] == [["DeepSpeedEngine", True], ["GradSyncDeepSpeedEngine", False]]
    assert result["trained_from_start"] > 0.02 and result["replicas_agree"]
    assert result["max_abs_difference_to_plain"] <= 1e-6


def test_acp_sgd_resumes_exactly_from_the_trainers_checkpoint(hf_job):
    """Trainer at ZeRO 1 with ACP-SGD (rank 2): stopped halfway with a checkpoint and resumed by a
    new Trainer, it ends where an uninterrupted run ends (the error feedback and the factors travel
    in DeepSpeed's checkpoint)."""
    assert hf_job["trainer_zero1_acp_sgd_resumed"]["max_abs_difference_to_straight"] == 0.0


def test_the_compression_hook_on_the_model_accelerate_prepares(hf_job):
    """Registered on Accelerate's DistributedDataParallel: the identity trains exactly as DDP's own
    all-reduce, ACP-SGD (rank 4) otherwise and alike on both ranks."""
    result = hf_job["accelerate_ddp_hook"]
    assert result["identity_difference_to_ddp"] <= 1e-6
    assert result["acp_sgd_difference_to_ddp"] > 1e-4 and result["acp_sgd_replicas_agree"]

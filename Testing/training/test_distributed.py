"""Several processes on a CPU: SFT under ``torchrun`` with 2 processes (gloo), and the refusal of
``accelerate launch --cpu`` asked for several processes (it would run one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from medvoltrain.cli import main
from medvoltrain.distributed import check_launcher

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.mark.slow  # SFT on two processes under torchrun
def test_sft_on_two_processes_under_torchrun(sm_data, tmp_path):
    from medvolcore import models

    models.resolve("tiny")  # build the tiny preset once, here, not in two children at the same time
    run = tmp_path / "RUN"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "medvoltrain", "sft", "--data", str(sm_data), "--output", str(run), "--preset", "tiny",
           "--max-steps", "2", "per_device_train_batch_size=1", "gradient_checkpointing=false", "logging_steps=1",
           "save_steps=2", "dataloader_num_workers=0", "report_to=none"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((run / "training.json").read_text(encoding="utf-8"))
    d = report["distributed"]
    assert (d["world_size"], d["backend"], d["per_device_batch"], d["gradient_accumulation_steps"]) == (2, "gloo", 1, 1)
    assert d["global_batch"] == 2 and report["global_step"] == 2
    # one adapter, written once by rank 0; no second copy or leftover temporary folder
    adapters = sorted(p.parent.relative_to(run).as_posix() for p in run.rglob("adapter_config.json")
                      if "checkpoints" not in p.parts)
    assert adapters == ["adapter"] and not list(run.glob(".adapter.tmp-*"))
    assert r.stdout.count("adapter written to") == 1, r.stdout
    # the other rank is quiet (rank 0's bf16 notice once) and DDP does not search for unused LoRA weights
    assert r.stderr.count("bfloat16 is not supported here") == 1
    assert "find_unused_parameters=True" not in r.stderr


def test_accelerate_cpu_with_several_processes_is_refused(monkeypatch, capsys, sm_data, tmp_path):
    # what accelerate's simple launcher (``accelerate launch --cpu --num_processes 2``) leaves to its ONE child
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["sft", "--data", str(sm_data), "--output", str(tmp_path / "RUN"), "--preset", "tiny"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "starts ONE process" in err[0]
    assert f"torchrun --nproc_per_node N -m medvoltrain sft --data {sm_data}" in err[0]
    assert not (tmp_path / "RUN").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launcher that starts the processes (torchrun, --multi_gpu)
    check_launcher(argv)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("MASTER_ADDR")  # --cpu with one process: nothing to refuse
    check_launcher(argv)

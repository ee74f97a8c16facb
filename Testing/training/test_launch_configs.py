"""The launch configurations in Training/configs parse with the launchers' own parsers: accelerate's
config class for the YAMLs, accelerate's DeepSpeed plugin for the ZeRO JSONs, torch.distributed.run's
argument parser (and ours) for the SLURM script's torchrun line. Nothing is launched."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[2] / "Training" / "configs"
REPO = CONFIGS.parents[1]


@pytest.mark.parametrize("name, kind, machines", [
    ("accelerate_ddp.yaml", "MULTI_GPU", 1), ("accelerate_zero2.yaml", "DEEPSPEED", 1),
    ("accelerate_zero3.yaml", "DEEPSPEED", 1), ("accelerate_multinode.yaml", "MULTI_GPU", 2)])
def test_accelerate_configs_load_with_accelerates_config_class(name, kind, machines):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    c = load_config_from_file(str(CONFIGS / name))  # a key accelerate does not know is refused here (ValueError)
    assert isinstance(c, ClusterConfig) and c.distributed_type.value == kind and c.num_machines == machines
    assert c.num_processes % c.num_machines == 0 and c.use_cpu is False
    if kind == "DEEPSPEED":
        assert (REPO / c.deepspeed_config["deepspeed_config_file"]).is_file()
    if machines > 1:  # the placeholder the README tells the user to replace (or override on the command line)
        assert c.main_process_ip == "MAIN_PROCESS_IP" and c.main_process_port == 29500 and c.machine_rank == 0


@pytest.mark.parametrize("name, stage", [("zero2.json", 2), ("zero3.json", 3)])
def test_deepspeed_configs_load_with_accelerates_plugin(name, stage):
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(hf_ds_config=str(CONFIGS / name))
    assert plugin.zero_stage == stage
    # batch sizes, accumulation, clipping and precision come from the training settings ("auto")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "bf16.enabled"):
        assert plugin.hf_ds_config.get_value(key) == "auto", key
    if stage == 3:  # the adapter is saved from gathered weights (runs.zero3_state_dict)
        assert plugin.zero3_save_16bit_model is True


def test_slurm_script_runs_torchrun_with_c10d_rendezvous_and_our_command():
    from torch.distributed.run import get_args_parser

    from medvoltrain.cli import build_parser

    script = CONFIGS / "slurm_sft.sbatch"
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith("srun "))
    words = shlex.split(line)
    args = get_args_parser().parse_args(words[words.index("torchrun") + 1:])
    assert (args.rdzv_backend, args.nnodes, args.module, args.training_script) == ("c10d", "$SLURM_NNODES", True,
                                                                                   "medvoltrain")
    assert args.rdzv_endpoint == "$HEAD_NODE:$RDZV_PORT" and args.rdzv_id == "$SLURM_JOB_ID"
    ours = build_parser().parse_args(args.training_script_args)
    assert ours.command == "sft" and ours.config == "Training/configs/sft.yaml"
    assert "#SBATCH --ntasks-per-node=1" in text  # one torchrun per node: it starts the node's processes

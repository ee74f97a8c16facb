"""Fixtures of the training tests: manifests built from the shared real CT, a prepared set, one SFT run.

The SFT run uses the ``tiny`` preset (built locally into the session's MEDVOL_HOME, no download)
and the 30-slice upper-abdomen CT (``example_ct_sm``), so a step takes about a second on a CPU.
"""

from __future__ import annotations

import pytest
from training_data import SFT_OVERRIDES, write_jsonl
from ts_labels import KIDNEY_LEFT, KIDNEY_RIGHT, LIVER, SPLEEN


@pytest.fixture(scope="session")
def sm_data(tmp_path_factory, ct_sm_path, seg_sm_path):
    """A prepared set from the 30-slice CT: liver, kidneys, spleen and one negative sample, the brain
    (train: the row says it is not in this CT; target <answer>[]</answer>), and liver (test)."""
    from medvoltrain.prepare import PrepareSettings, prepare

    root = tmp_path_factory.mktemp("sm_data")
    manifest = write_jsonl(root / "cases.jsonl", [
        {"id": "sm_a", "volume": str(ct_sm_path), "labels": str(seg_sm_path), "split": "train",
         "targets": {"liver": LIVER, "kidneys": [KIDNEY_RIGHT, KIDNEY_LEFT], "spleen": SPLEEN}, "absent": ["brain"]},
        {"id": "sm_b", "volume": str(ct_sm_path), "labels": str(seg_sm_path), "split": "test",
         "targets": {"liver": LIVER}},
    ])
    # fraction 0.25: one negative for three positives (the SFT and GRPO tests train on it)
    prepare(manifest, root / "DATA", PrepareSettings(seed=1, top_k=2, negative_fraction=0.25), workers=1,
            progress=False)
    return root / "DATA"




@pytest.fixture(scope="session")
def sft_run(tmp_path_factory, sm_data):
    """Four SFT steps on the tiny model through the CLI (lr raised to 0.02 so that 4 steps show a trend)."""
    from medvoltrain.cli import main

    run = tmp_path_factory.mktemp("sft") / "RUN"
    rc = main(["sft", "--data", str(sm_data), "--output", str(run), "--preset", "tiny", "--max-steps", "4",
               *SFT_OVERRIDES])
    assert rc == 0
    return run

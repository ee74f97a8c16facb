"""What the training tests share besides fixtures: writing a JSON-lines manifest and the SFT
overrides of the short runs (``from training_data import write_jsonl``)."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


SFT_OVERRIDES = ["learning_rate=0.02", "logging_steps=1", "save_steps=2", "dataloader_num_workers=0",
                 "report_to=tensorboard", "warmup_ratio=0.0"]

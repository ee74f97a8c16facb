"""No product file of the engine or the training package over 600 lines, as in the Slicer wing
(``Testing/slicer_lib/test_module_files.py``): a file that grows past it is split by concern
(docs/architecture.md, "Layers")."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("MedVolCore", "Training")
MAX_LINES = 600


def _product_files():
    skip = {"__pycache__", "build", "dist", ".venv"}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO).parts
            if not skip & set(parts) and not any(p.endswith(".egg-info") for p in parts):
                yield path.relative_to(REPO).as_posix(), path


def _sizes():
    return {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in _product_files()}


def test_no_product_file_is_over_600_lines():
    sizes = _sizes()
    assert len(sizes) > 100 and "MedVolCore/medvolcore/cli/app.py" in sizes and "Training/medvoltrain/cli.py" in sizes
    big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert big == {}, f"split these by concern (docs/architecture.md, 'Layers'): {big}"


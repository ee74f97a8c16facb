"""The test data the repository carries (``Testing/data``) is all there and unchanged.

Tests that need a data file skip when it is absent (``conftest._require``), which is right for a
folder given by ``$MEDVOL_REAL_DATA`` but would let a damaged checkout pass by skipping; this test
fails instead. It reads the repository's own folder whatever ``$MEDVOL_REAL_DATA`` says.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
MANIFEST = json.loads((DATA / "manifest.json").read_text(encoding="utf-8"))["files"]


@pytest.mark.parametrize("rel", sorted(MANIFEST))
def test_carried_file_matches_its_manifest_entry(rel):
    path = DATA / rel
    assert path.is_file(), f"{path} is missing from the checkout"
    data = path.read_bytes()
    assert len(data) == MANIFEST[rel]["bytes"], f"{rel}: size differs from manifest.json"
    assert hashlib.sha256(data).hexdigest() == MANIFEST[rel]["sha256"], f"{rel}: content differs from manifest.json"


def test_manifest_lists_every_carried_file_and_the_readme_names_each():
    on_disk = {p.relative_to(DATA).as_posix() for p in DATA.rglob("*")
               if p.is_file() and p.name not in ("README.md", "manifest.json")}
    assert on_disk == set(MANIFEST), "Testing/data and its manifest.json disagree"
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    for rel in MANIFEST:  # every file has its origin and licence note
        assert f"`{Path(rel).name}`" in readme, f"{rel} is not described in Testing/data/README.md"


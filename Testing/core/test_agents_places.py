"""What an agent may name (medvolcore/agents/places.py): the folder a path lies in, decided from
its text alone, for any text (Hypothesis), and the output folder kept apart from the allowed ones."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medvolcore.agents.places import Places, check_places
from medvolcore.errors import ForbiddenError, InputError
from medvolcore.pacs import PacsServer

ROOTS = ["/srv/ct", "/srv/ct-archive", "/data/scans"]
PARTS = st.sampled_from(["..", ".", "", "ct.nii.gz", "sub", "srv", "ct", "ct-archive", "data", "scans", "a..b", "~"])


def _inside(path: str, root: str) -> bool:
    return path.startswith(root + os.sep)


@settings(max_examples=300, deadline=None)
@given(start=st.sampled_from(ROOTS + ["/", "/srv", "", "relative"]), parts=st.lists(PARTS, max_size=8))
def test_a_path_is_placed_in_the_root_its_text_leads_into_or_refused(start, parts):
    places = Places([__import__("pathlib").Path(r) for r in ROOTS])
    text = "/".join([start] + parts) if start else "/".join(parts)
    expected = os.path.normpath(os.path.expanduser(text)) if os.path.isabs(os.path.expanduser(text)) else None
    if expected is not None:
        expected = "/" + expected.lstrip("/")  # POSIX keeps a leading "//", which names the same place here
    try:
        root, rel = places.volume(text)
    except ForbiddenError as e:
        # refused only when the normalised path lies in no allowed folder (or is one itself, or relative)
        assert expected is None or not any(_inside(expected, r) for r in ROOTS), (text, str(e))
        assert "\n" not in str(e)
        return
    assert expected is not None and root is not None
    full = os.path.normpath(os.path.join(str(root), rel))
    assert full == expected and _inside(full, str(root))
    assert ".." not in rel.split(os.sep) and not os.path.isabs(rel)


def test_a_relative_path_needs_exactly_one_root():
    from pathlib import Path

    assert Places([Path("/srv/ct")]).volume("sub/ct.nii.gz") == (Path("/srv/ct"), "sub/ct.nii.gz")
    with pytest.raises(ForbiddenError, match="relative"):
        Places([Path("/srv/ct"), Path("/data")]).volume("sub/ct.nii.gz")
    with pytest.raises(ForbiddenError, match="outside"):
        Places([Path("/srv/ct")]).volume("../etc/passwd")


def test_series_only_on_allowed_servers_and_refusals_say_what_is_allowed():
    from medvolcore.pacs import Limits

    server = PacsServer("orthanc", "http://127.0.0.1:8042/dicom-web", None, Limits())
    places = Places([], {"orthanc": server})
    url = "dicomweb://127.0.0.1:8042/dicom-web/studies/1.2/series/1.2.3"
    assert places.volume(url) == (None, url)
    for other in ("dicomweb://127.0.0.1:9999/dicom-web/studies/1.2/series/1.2.3",
                  "https://127.0.0.1:8042/dicom-web/studies/1.2/series/1.2.3", "/srv/ct/ct.nii.gz"):
        with pytest.raises(ForbiddenError) as e:
            places.volume(other)
        assert "orthanc (http://127.0.0.1:8042/dicom-web)" in str(e.value)
    assert places.server("orthanc") is server
    with pytest.raises(ForbiddenError, match="allowed: orthanc"):
        places.server("pacs2")


def test_the_output_folder_overlaps_no_allowed_folder(tmp_path):
    (tmp_path / "data" / "out").mkdir(parents=True)
    (tmp_path / "results").mkdir()
    roots, out = check_places([tmp_path / "data"], tmp_path / "results")
    assert roots == [tmp_path / "data"] and out == tmp_path / "results"
    for bad in (tmp_path / "data", tmp_path / "data" / "out", tmp_path):
        with pytest.raises(InputError, match="overlaps"):
            check_places([tmp_path / "data"], bad)
    os.symlink(tmp_path / "data", tmp_path / "alias")  # the same folder by another name
    with pytest.raises(InputError, match="overlaps"):
        check_places([tmp_path / "alias" / "out"], tmp_path / "data")

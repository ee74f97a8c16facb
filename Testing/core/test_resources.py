"""Resources (medvolcore.resources): the data the package carries."""

from __future__ import annotations

from medvolcore.resources import load_json, resource_path

SAMPLE = resource_path("samples", load_json("samples", "samples.json")["demo"]["file"])


def test_sample_is_the_carried_upper_abdomen_ct(ct_sm_path):
    assert SAMPLE.read_bytes() == ct_sm_path.read_bytes()

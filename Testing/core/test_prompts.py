"""Correction prompts (medvolcore.prompts): an anchor's boxes and prompts planned per object and slice."""

from __future__ import annotations

from medvolcore.prompts import plan_objects

from core.test_anchor import PROMPTS, D, H, W


def test_plan_groups_prompts_per_object_and_slice():
    objs = plan_objects(50, [[30, 30, 60, 60], [70, 30, 90, 50]], PROMPTS, width=W, height=H, depth=D)
    assert [(o.number, o.start, o.slices) for o in objs] == [(1, 50, [50, 62]), (2, 50, [50]), (3, 30, [30, 35])]
    assert objs[0].frames[62] == ((28, 32, 58, 66), [(40, 40, 0), (45, 50, 1)])
    assert objs[1].frames[50] == ((70, 30, 90, 50), [(80, 40, 0)])
    assert objs[2].frames[30] == (None, [(60, 70, 1)]) and not objs[2].seeded_by_key

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


def test_mask_prompts_plan_as_the_only_input_of_their_slice():
    import pytest

    from medvolcore.errors import InputError
    from medvolcore.prompts import MAX_MASK_RUNS, check_mask_runs

    disc = {"runs": [W * 40 + 30, 6, W * 41 + 29, 8]}
    objs = plan_objects(50, [[30, 30, 60, 60]], [
        {"slice": 62, "object": 1, "mask": disc},
        {"slice": 50, "object": 1, "mask": {"runs": [W * 45 + 40, 3]}},      # replaces the key box
        {"slice": 70, "object": 2, "mask": disc},                             # a new object from a mask
        {"slice": 75, "object": 2, "box": None, "points": [[3, 3, 0]]},
    ], width=W, height=H, depth=D)
    assert objs[0].frames == {50: (None, []), 62: (None, [])} and objs[0].masks[62] == tuple(disc["runs"])
    assert objs[1].start == 70 and objs[1].masks.keys() == {70} and objs[1].frames[75] == (None, [(3, 3, 0)])
    assert check_mask_runs([0, 1, 2, 3], W, H) == (0, 1, 2, 3)
    with pytest.raises(InputError, match="not after the previous run"):
        check_mask_runs([0, 2, 2, 3], W, H)  # touching runs are one run: one encoding per mask
    with pytest.raises(InputError, match="at most 16"):
        plan_objects(50, [[30, 30, 60, 60]], [{"slice": z, "object": 1, "mask": disc} for z in range(17)],
                     width=W, height=H, depth=D)
    many = {"runs": [v for i in range(MAX_MASK_RUNS // 2 + 1) for v in (2 * i, 1)]}
    with pytest.raises(InputError, match=f"at most {MAX_MASK_RUNS:,} are allowed in all"):
        plan_objects(50, [[30, 30, 60, 60]], [{"slice": 60, "object": 1, "mask": many},
                                              {"slice": 61, "object": 1, "mask": many}], width=W, height=H, depth=D)

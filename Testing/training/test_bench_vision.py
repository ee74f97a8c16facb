"""The vision sanity stage (``medvol-train bench-vision``): the synthetic task is what it claims, and
a model trained through the product's data path reads its slices — its key slice is right with its
own slices and falls to chance with another volume's or black ones, so a broken image path fails here."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from medvolcore.errors import InputError
from medvoltrain.bench.common import CONDITIONS, ablated_images, mean_se, standard_error, swap_partners
from medvoltrain.bench.model import MODEL_SIZES, sincos_positions
from medvoltrain.bench.report import METRICS
from medvoltrain.bench.vision import VisionBenchSettings, build_cases, goals, held_out
from medvoltrain.errors import DataError
from medvoltrain.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.mark.parametrize("placement, hold_out", [("free", "positions"), ("grid", "volumes"), ("grid", "positions")])
def test_cases_are_canonical_stacks_with_the_square_where_the_split_says(tmp_path, placement, hold_out):
    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_label_map, load_volume

    s = VisionBenchSettings(placement=placement, hold_out=hold_out, depth=8, object_slices=3, train_cases=30,
                            test_cases=12).validate()
    rows = build_cases(tmp_path, s)
    assert [r["split"] for r in rows].count("test") == 12
    train_corners = {(r["square"]["x0"], r["square"]["y0"]) for r in rows if r["split"] == "train"}
    token = s.size // 4  # the bench model's patch 32: 4 x 4 image tokens on a 256-pixel slice
    assert s.tokens_per_side == 4 and s.checker_cell == (token if placement == "grid" else s.cell)
    for r in rows:
        sq = r["square"]
        if hold_out == "positions":
            assert held_out(sq["x0"], sq["y0"], s.checker_cell) == (r["split"] == "test")
            if r["split"] == "test":
                assert (sq["x0"], sq["y0"]) not in train_corners
        if placement == "grid":  # exactly one image token
            assert sq["side"] == token and sq["x0"] % token == 0 and sq["y0"] % token == 0
        else:
            assert s.side_min <= sq["side"] <= s.side_max
    if hold_out == "volumes":  # test volumes reuse the grid's positions, and the split does not look at them
        test_corners = {(r["square"]["x0"], r["square"]["y0"]) for r in rows if r["split"] == "test"}
        assert test_corners & train_corners
        assert any(held_out(x, y, token) for x, y in train_corners)
    for r in rows[:3] + rows[-3:]:
        sq = r["square"]
        stack = AxialStack.from_volume(load_volume(r["volume"])).data
        lab = AxialStack.from_volume(load_label_map(r["labels"])).data
        assert stack.shape == (s.depth, s.size, s.size)
        areas = (lab > 0).sum(axis=(1, 2))
        # the square sits where the row says, in the canonical stack's own axes, largest on the key slice
        assert int(np.argmax(areas)) == sq["key_slice"] and areas[sq["key_slice"]] == sq["side"] ** 2
        assert np.count_nonzero(areas) == s.object_slices
        key = lab[sq["key_slice"]]
        ys, xs = np.nonzero(key)
        assert (ys.min(), xs.min()) == (sq["y0"], sq["x0"])
        assert stack[sq["key_slice"]][key > 0].mean() > 250 > stack[sq["key_slice"]][key == 0].mean()


def test_held_out_is_a_checkerboard():
    assert not held_out(0, 0, 3) and held_out(3, 0, 3) and held_out(0, 5, 3) and not held_out(4, 4, 3)


def test_seeing_model_has_fast_image_rotary_steps_and_a_sincos_position_table():
    text = MODEL_SIZES["seeing"]["text"]
    theta, d = text["rope_parameters"]["rope_theta"], text["head_dim"]
    sec = text["rope_parameters"]["mrope_section"]
    # interleaved M-RoPE: rows take frequency indices 1, 4, 7, … and columns 2, 5, 8, …
    row_step = theta ** (-2 * 1 / d)
    col_step = theta ** (-2 * 2 / d)
    assert row_step > 0.5 and col_step > 0.3 and sum(sec) == d // 2
    code = sincos_positions(256, 64)
    assert code.shape == (256, 64) and np.abs(code).max() <= 1.0
    rows = code.reshape(16, 16, 64)
    assert np.allclose(rows[3, 0, :16], rows[3, 9, :16])  # row channels do not change along a row
    assert not np.allclose(rows[3, 0, 32:48], rows[3, 9, 32:48])  # column channels do
    assert len({tuple(np.round(r, 5)) for r in code}) == 256  # every grid cell has its own code
    with pytest.raises(InputError, match="square grid"):
        sincos_positions(250, 64)


def test_ablated_images_swap_another_volume_or_black_out(tmp_path):
    from medvoltrain.prepare import PrepareSettings, load_samples, prepare

    s = VisionBenchSettings.quick_settings(train_cases=2, test_cases=4).validate()
    build_cases(tmp_path, s)
    prepare(tmp_path / "cases.jsonl", tmp_path / "data", PrepareSettings(top_k=1), progress=False)
    test = load_samples(tmp_path / "data", "test")
    own = ablated_images(test, 0, "own")
    swapped = ablated_images(test, 0, "swapped")
    black = ablated_images(test, 0, "black")
    other = ablated_images(test, 1, "own")
    assert len(own) == len(swapped) == len(black) == s.depth
    assert all(np.array_equal(a, b) for a, b in zip(swapped, other))
    assert not all(np.array_equal(a, b) for a, b in zip(own, swapped))
    assert all(b.shape == a.shape and not b.any() for a, b in zip(own, black))
    with pytest.raises(InputError, match="unknown image condition"):
        ablated_images(test, 0, "grey")


def test_swap_partners_take_the_next_sample_of_another_group():
    samples = [{"case_id": c} for c in ("a", "a", "b", "c")]
    assert swap_partners(samples) == [2, 2, 3, 0]
    bands = {"a": 0, "b": 0, "c": 1}  # bench-learning groups by test band: b shares a's band
    assert swap_partners(samples, group=lambda s: bands[s["case_id"]]) == [3, 3, 3, 0]
    with pytest.raises(DataError, match="same volume"):
        swap_partners([{"case_id": "a"}, {"case_id": "a"}])


def test_standard_error_of_the_mean_by_hand():
    # values 0, 1, 1, 0: sample standard deviation sqrt(1/3), over sqrt(4)
    assert standard_error([0, 1, 1, 0]) == pytest.approx(math.sqrt(1 / 3) / 2)
    assert mean_se([0, 1, 1, 0]) == {"mean": 0.5, "se": 0.2887}
    assert math.isnan(standard_error([0.7])) and math.isnan(standard_error([0.5, float("nan")]))
    assert math.isnan(mean_se([1.0])["se"])


@pytest.mark.parametrize("kw, message", [
    (dict(test_cases=1), "swapped-slices control"),
    (dict(placement="free", side_max=30, size=20), "side_max"),
    (dict(placement="grid", size=30), "multiple of the 4 image tokens"),
    (dict(placement="random"), "placement must be"),
    (dict(hold_out="cases"), "hold_out must be"),
    (dict(object_slices=9, depth=8), "object_slices"),
    (dict(model="huge"), "model must be"),
    (dict(threads=-1), "threads must be"),
])
def test_settings_are_checked(kw, message):
    with pytest.raises(InputError, match=message):
        VisionBenchSettings(**kw).validate()


def test_cli_passes_placement_and_hold_out_and_quick_keeps_its_own(tmp_path, monkeypatch):
    import medvoltrain.bench.vision as bv  # the module cmd_bench_vision calls through

    seen = []
    monkeypatch.setattr(bv, "run_vision_benchmark", lambda out, settings, **kw: seen.append(settings) or {})
    assert main(["bench-vision", "--out", str(tmp_path / "a"), "--placement", "free", "--hold-out", "positions"]) == 0
    assert main(["bench-vision", "--out", str(tmp_path / "b")]) == 0
    assert main(["bench-vision", "--out", str(tmp_path / "c"), "--quick"]) == 0
    assert [(s.placement, s.hold_out, s.steps) for s in seen] == [("free", "positions", 2400), ("grid", "volumes", 2400),
                                                                 ("free", "positions", 600)]


def test_goals_compare_against_chance():
    def scores(own_key, own_box, sw_key, sw_box):
        m = lambda v: {"mean": v, "se": 0.01}  # noqa: E731
        return {"own": {"key": m(own_key), "box": m(own_box)}, "swapped": {"key": m(sw_key), "box": m(sw_box)}}

    good = goals({"scores": scores(0.9, 0.6, 0.2, 0.05), "chance": {"key": 1 / 6}})
    assert all(good.values())
    bad = goals({"scores": scores(0.9, 0.2, 0.9, 0.2), "chance": {"key": 1 / 6}})
    assert not bad["own box ≥ 0.5"] and not bad["swapped key ≤ chance + 0.1"] and not bad["swapped box ≤ 0.15"]


@pytest.mark.slow  # trains a model for about 2 minutes
def test_quick_stage_learns_the_key_slice_from_pixels(tmp_path, capsys):
    """The CI variant: trained through prepare → prompt builder → collator → train_sft, the model finds
    the slice with the square on held-out volumes, and only with its own slices.

    Bounds from measured runs of this variant (seed 0): see docs/learning-benchmarks.md. A model that ignores
    the images scores the same under all three conditions (the real-CT benchmark's SFT model did)."""
    out = tmp_path / "VISION"
    assert main(["bench-vision", "--out", str(out), "--quick", "--threads", "2"]) == 0
    result = json.loads((out / "result.json").read_text(encoding="utf-8"))
    sc, chance = result["scores"], result["chance"]["key"]
    assert set(sc) == set(CONDITIONS) and all(set(METRICS) <= set(sc[c]) for c in CONDITIONS)
    assert chance == pytest.approx(0.25)
    assert sc["own"]["format"]["mean"] >= 0.9
    assert sc["own"]["key"]["mean"] >= 0.7
    for cond in ("swapped", "black"):
        assert sc[cond]["key"]["mean"] <= chance + 0.2, cond
        assert sc["own"]["key"]["mean"] - sc[cond]["key"]["mean"] >= 0.4, cond
    assert sc["own"]["box"]["mean"] > sc["swapped"]["box"]["mean"]
    assert all(math.isfinite(sc[c][m]["se"]) for c in CONDITIONS for m in METRICS)
    table = (out / "table.md").read_text(encoding="utf-8")
    assert table.startswith("| images |") and "Held out: positions" in table
    # a second run in the same folder is refused without --overwrite, with one line
    capsys.readouterr()
    assert main(["bench-vision", "--out", str(out), "--quick"]) != 0
    assert "--overwrite" in capsys.readouterr().err

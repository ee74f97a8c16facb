"""The presence stage (``medvol-train bench-vision --task presence``, medvoltrain.bench.presence): its
cases and the swap that makes chance, its settings and command line checked, a grounder that may
answer "not present", and a quick run that learns to say so from the pixels."""

from __future__ import annotations

import json

import numpy as np
import pytest

from medvolcore.errors import InputError
from medvoltrain.cli import main
from medvoltrain.errors import DataError

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def test_presence_cases_and_the_swap_that_makes_chance(tmp_path):
    """Half the volumes hold the square (where the row says); prepare makes the others negative samples;
    the swapped control pairs half of each class across the classes, so a pixel reader scores chance."""
    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_label_map, load_volume
    from medvoltrain.bench.presence import PresenceBenchSettings, build_presence_cases, presence_partners
    from medvoltrain.prepare import PrepareSettings, load_samples, prepare

    s = PresenceBenchSettings.quick_settings(train_cases=2, test_cases=8).validate()
    rows = build_presence_cases(tmp_path, s)
    assert [r["present"] for r in rows if r["split"] == "test"] == [True, False] * 4
    for r in rows[:2]:
        lab = AxialStack.from_volume(load_label_map(r["labels"])).data
        hu = AxialStack.from_volume(load_volume(r["volume"])).data
        if r["present"]:  # on object_slices consecutive slices, the row's z (the key slice) the largest
            sq, areas = r["square"], lab.reshape(lab.shape[0], -1).sum(1)
            assert lab[sq["z"], sq["y0"], sq["x0"]] == 1 and areas[sq["z"]] == sq["side"] ** 2 == areas.max()
            assert np.count_nonzero(areas) == s.object_slices == 3 and hu[lab > 0].mean() > 250
        else:
            assert not lab.any() and hu.max() < 200
    prepare(tmp_path / "cases.jsonl", tmp_path / "data", PrepareSettings(top_k=1, negative_fraction=0.5),
            progress=False)
    test = load_samples(tmp_path / "data", "test")
    assert [s["absent"] for s in test] == [False, True] * 4  # one sample per volume, in volume order
    partners = presence_partners(test)
    cross = [test[j]["absent"] != test[k]["absent"] for j, k in enumerate(partners)]
    assert all(k != j for j, k in enumerate(partners))
    for truth in (False, True):  # half of each class is shown a volume of the other class
        assert sum(c for c, t in zip(cross, test) if t["absent"] == truth) == 2
    # a model that answers from the pixels shown: right on same-class pairs, wrong on cross ones → 0.5
    assert np.mean([not c for c in cross]) == 0.5
    with pytest.raises(DataError, match="as many volumes with the object as without"):
        presence_partners(test[:5])


def test_presence_settings_and_cli_are_checked(tmp_path, capsys, monkeypatch):
    import medvoltrain.bench.presence as bp
    from medvoltrain.bench.presence import PresenceBenchSettings, presence_goals

    with pytest.raises(InputError, match="multiple of 4"):
        PresenceBenchSettings(test_cases=6).validate()
    assert presence_goals({"own": 0.95, "swapped": 0.6, "chance": 0.5}) == {
        "own ≥ 0.9": True, "swapped within 0.15 of chance": True}
    assert presence_goals({"own": 0.85, "swapped": 0.9, "chance": 0.5}) == {
        "own ≥ 0.9": False, "swapped within 0.15 of chance": False}
    assert main(["bench-vision", "--task", "presence", "--out", str(tmp_path), "--placement", "grid"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--placement is a setting of the key-slice task" in err[0]
    seen = []
    monkeypatch.setattr(bp, "run_presence_benchmark", lambda out, settings, **kw: seen.append(settings) or {})
    assert main(["bench-vision", "--task", "presence", "--out", str(tmp_path / "q"), "--quick", "--steps", "7"]) == 0
    assert seen[0].quick and seen[0].steps == 7 and seen[0].train_cases == PresenceBenchSettings.quick_settings().train_cases


def test_presence_grounder_allows_the_absent_answer(tmp_path):
    """The benchmark model is a smoke model, whose preset keeps to box answers; the stage must lift
    that, or no answer could be [] and every run would score 0.5 however well the model learnt."""
    from medvolcore.grounder import QwenVLGrounder
    from medvolcore.grounder.prompt import answer_grammar
    from medvoltrain.bench.model import build_model
    from medvoltrain.bench.presence import presence_grounder

    model_dir = build_model(tmp_path / "model", "seeing")
    plain, stage = QwenVLGrounder.from_pretrained(model_dir), presence_grounder(model_dir)
    assert plain.is_smoke and stage.is_smoke and stage.settings["preset"] == plain.settings["preset"] == "tiny"
    assert plain.settings["allow_absent"] is False and stage.settings["allow_absent"] is True
    assert {k: v for k, v in stage.settings.items() if k != "allow_absent"} == \
        {k: v for k, v in plain.settings.items() if k != "allow_absent"}
    grammar = answer_grammar([0, 1], 24, 1, stage.settings["allow_absent"])
    assert ' entry? "]</answer>"' in grammar.splitlines()[0]


@pytest.mark.slow  # trains a model
def test_quick_presence_stage_says_not_present_from_pixels(tmp_path):
    """The CI variant of the presence stage: trained through prepare (negatives) → prompt builder →
    collator → train_sft and answering through the answer grammar and parser, the model says [] exactly
    when the volume has no bright object, and follows the slices it is shown (bounds:
    docs/learning-benchmarks.md, "Can it say 'not present'?")."""
    out = tmp_path / "PRESENCE"
    assert main(["bench-vision", "--task", "presence", "--out", str(out), "--quick"]) == 0
    result = json.loads((out / "result.json").read_text(encoding="utf-8"))
    p, sc = result["presence"], result["scores"]
    assert set(p) == {"own", "swapped", "black", "chance"} and p["chance"] == 0.5
    assert result["data"]["test_samples"] == 2 * result["data"]["test_absent"]
    assert p["own"] >= 0.9 and abs(p["swapped"] - p["chance"]) <= 0.15
    assert sc["swapped"]["follows_shown"]["mean"] >= 0.9  # it answers what the shown slices hold
    assert sc["black"]["said_absent"]["mean"] >= 0.9 and sc["own"]["format"]["mean"] == 1.0
    assert all(result["goals"].values())

"""Early stop (``--stop-after-empty K``) through the command line, the pipeline and ``medvol batch``.

The propagator's own behaviour (slices visited, masks equal to a full run, objects that end while
others go on, batched tracking) is tested in test_propagation.py. Here the masks are made to
follow a real label (Testing/reference/controlled_masks.py: sam2 runs in full, its mask output
is replaced), so that a target really ends and the plumbing can be checked end to end.
"""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from medvolcore.cli import main
from medvolcore.errors import InputError
from medvolcore.pipeline import Pipeline
from medvolcore.propagation import DEFAULT_STOP_AFTER_EMPTY
from medvolcore.propagation._sam2_predictor import MedSAM2VideoPredictor
from medvolcore.stack import AxialStack
from medvolcore.volume import label_mask, load_label_map, load_volume

from ts_labels import KIDNEY_RIGHT
from reference.controlled_masks import controlled_masks

FIRST, LAST, KEY = 11, 20, 15  # the controlled target: the right kidney on stack slices 11..20 only


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def kidney(ct_sm_path, seg_sm_path):
    """The 30-slice CT's right kidney (stack slices 11..29), cut to slices 11..20 as the target."""
    stack = AxialStack(load_volume(ct_sm_path))
    target = stack.to_stack(label_mask(load_label_map(seg_sm_path), KIDNEY_RIGHT)).astype(bool)
    zs = np.nonzero(target.any(axis=(1, 2)))[0]
    assert (zs.min(), zs.max()) == (FIRST, 29)
    target[LAST + 1:] = False
    ys, xs = np.nonzero(target[KEY])
    box = [int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())]
    return stack, target, box


def test_cli_propagate_stops_where_the_target_ends(capsys, tmp_path, ct_sm_path, kidney):
    stack, target, box = kidney
    common = ["propagate", "--volume", ct_sm_path, "--slice", KEY, "--box", *box, "--random-weights", 0,
              "--image-size", 64, "--json", "--no-progress"]
    with controlled_masks(MedSAM2VideoPredictor, [target]):
        code, out, err = run_cli(capsys, *common, "--out", tmp_path / "early.nii.gz", "--stop-after-empty", 1,
                                 "--anchor-out", tmp_path / "early.anchor.json")
        assert code == 0, err
        early = json.loads(out)
        code, out, err = run_cli(capsys, *common, "--out", tmp_path / "full.nii.gz", "--stop-after-empty", 0)
        assert code == 0, err
        full = json.loads(out)
    p = early["propagation"]
    assert p["stop_after_empty"] == 1 and p["slice_range"] == [FIRST - 1, LAST + 1] == early["slice_range"]
    assert p["window_range"] == [0, stack.depth - 1]
    assert p["directions"]["forward"] == {"last_slice": LAST + 1, "slices": LAST + 1 - KEY, "stopped_early": True,
                                          "objects_stopped": [[0, LAST + 1]]}
    assert p["directions"]["backward"]["last_slice"] == FIRST - 1 and p["directions"]["backward"]["stopped_early"]
    assert early["slices_encoded"] == LAST - FIRST + 3 and full["slices_encoded"] == stack.depth
    assert full["propagation"]["slice_range"] == [0, stack.depth - 1]
    assert not any(d["stopped_early"] for d in full["propagation"]["directions"].values())
    # the anchor file records the run; the masks are identical (the target ended there)
    assert json.loads((tmp_path / "early.anchor.json").read_text())["propagation"] == p
    m_early, m_full = (np.asarray(nib.load(str(tmp_path / f)).dataobj) for f in ("early.nii.gz", "full.nii.gz"))
    assert np.array_equal(m_early, m_full)
    on_stack = stack.to_stack(m_early).any(axis=(1, 2))
    assert on_stack[FIRST:LAST + 1].all() and not on_stack[:FIRST].any() and not on_stack[LAST + 1:].any()


@pytest.mark.parametrize("command", ["propagate", "segment", "batch"])
def test_bad_stop_after_empty_is_one_line(capsys, tmp_path, ct_sm_path, command):
    args = {"propagate": ["--slice", 3, "--box", 1, 1, 5, 5, "--random-weights", 0, "--out", tmp_path / "m.nii.gz"],
            "segment": ["--query", "liver", "--preset", "tiny", "--out", tmp_path / "m.nii.gz"],
            "batch": ["--manifest", tmp_path / "none.csv", "--out-dir", tmp_path / "b", "--preset", "tiny"]}[command]
    volume = [] if command == "batch" else ["--volume", ct_sm_path]
    code, _, err = run_cli(capsys, command, *volume, *args, "--stop-after-empty", -2, "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "--stop-after-empty" in err and "≥ 0" in err


def test_pipeline_default_and_per_call_override(ct_sm_path, kidney):
    stack, target, box = kidney
    assert DEFAULT_STOP_AFTER_EMPTY > 0
    pipe = Pipeline("tiny", device="cpu")
    assert pipe.stop_after_empty == DEFAULT_STOP_AFTER_EMPTY
    anchor = {"schema": "medvol.anchor/1", "slice": KEY, "boxes": [box], "source": "user"}
    with controlled_masks(pipe.propagator.predictor, [target]):
        seg = pipe.repropagate(stack, anchor)
        full = pipe.repropagate(stack, anchor, stop_after_empty=0)
    k = DEFAULT_STOP_AFTER_EMPTY
    assert seg.anchor.propagation["stop_after_empty"] == k
    assert seg.propagation.slice_range == (FIRST - k, LAST + k)
    assert seg.timings["slices_propagated"] == LAST - FIRST + 1 + 2 * k
    assert seg.anchor.to_dict()["propagation"]["directions"]["forward"]["last_slice"] == LAST + k
    assert full.anchor.propagation["stop_after_empty"] == 0 and full.propagation.slices_encoded == stack.depth
    assert np.array_equal(seg.mask, full.mask)
    with pytest.raises(InputError, match="stop_after_empty"):
        Pipeline("tiny", device="cpu", stop_after_empty=-1)
    with pytest.raises(InputError, match="stop_after_empty"):
        pipe.repropagate(stack, anchor, stop_after_empty="2")
    # the record is not read back: an edited anchor gets a fresh one
    from medvolcore.anchor import EvidenceAnchor

    assert EvidenceAnchor.from_dict(seg.anchor.to_dict(), stack).propagation is None


def test_batch_passes_the_option_and_records_it(tmp_path, ct_sm_path):
    from medvolcore.batch import BatchOptions, run_batch

    manifest = tmp_path / "cases.csv"
    manifest.write_text(f"id,volume,query\nc1,{ct_sm_path},the liver\n", encoding="utf-8")
    res = run_batch(manifest, tmp_path / "out", BatchOptions(preset="tiny", device="cpu", stop_after_empty=0,
                                                             progress=False))
    assert res.exit_code == 0
    done = json.loads((tmp_path / "out" / "c1" / "done.json").read_text())
    assert done["propagation"]["stop_after_empty"] == 0
    assert done["propagation"]["slice_range"] == [0, 29]
    assert json.loads((tmp_path / "out" / "c1" / "anchor.json").read_text())["propagation"] == done["propagation"]

"""What ``medvol`` says: ``--json`` errors as JSON on stdout, libraries' warnings silenced unless
``--debug``, ``medvol propagate --preset`` (the preset's MedSAM2 weights, no path to dig out)."""

from __future__ import annotations

import json
import warnings

import nibabel as nib
import numpy as np

from medvolcore.cli import main

from core.test_jobs import BOX


def test_json_errors_are_json_on_stdout(capsys, tmp_path):
    code = main(["info", str(tmp_path / "no_such_ct.nii.gz"), "--json"])
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert code == 2 and d["ok"] is False and d["command"] == "info"
    assert d["error"]["code"] == "bad_volume" and "does not exist" in d["error"]["message"]
    assert d["error"]["exit_code"] == 2 and len(err.strip().splitlines()) == 1  # the line for people stays
    code = main(["info", str(tmp_path / "no_such_ct.nii.gz")])
    assert capsys.readouterr().out == ""  # without --json, stdout stays empty


def test_library_warnings_are_silenced_unless_debug(capsys, small_ct, monkeypatch):
    import medvolcore.cli.steps as steps_cli

    real = steps_cli.cmd_info

    def noisy(args):  # as transformers does on every generate()
        warnings.warn_explicit("`past_key_values` as a tuple is deprecated", FutureWarning,
                               "transformers/generation/utils.py", 1, module="transformers.generation.utils")
        warnings.warn_explicit("our own warning", UserWarning, "medvolcore/x.py", 1, module="medvolcore.x")
        return real(args)

    monkeypatch.setattr(steps_cli, "cmd_info", noisy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["info", str(small_ct[0])]) == 0
    assert [str(w.message) for w in seen] == ["our own warning"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["info", str(small_ct[0]), "--debug"]) == 0
    assert "`past_key_values` as a tuple is deprecated" in [str(w.message) for w in seen]
    capsys.readouterr()


def test_propagate_takes_a_presets_weights(capsys, tmp_path, small_ct):
    out = tmp_path / "m.nii.gz"
    code = main(["propagate", "--volume", str(small_ct[0]), "--slice", "3", "--box", *map(str, BOX), "--out", str(out),
                 "--preset", "tiny", "--no-progress", "--json"])
    o, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(o)["weights"].startswith("random(seed=") and nib.load(str(out)).shape == \
        np.asarray(nib.load(str(small_ct[0])).dataobj).shape
    code = main(["propagate", "--volume", str(small_ct[0]), "--slice", "3", "--box", *map(str, BOX), "--out",
                 str(tmp_path / "n.nii.gz")])
    err = capsys.readouterr().err
    assert code == 2 and "--preset NAME" in err and "medvol models download" in err
    code = main(["propagate", "--volume", str(small_ct[0]), "--slice", "3", "--box", *map(str, BOX), "--out",
                 str(tmp_path / "n.nii.gz"), "--preset", "qwen3-vl-4b"])
    err = capsys.readouterr().err
    assert code != 0 and "download" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "--preset tiny" in err and "medvol demo" in err  # not only a download of several GB


def test_propagate_writes_every_out_given(capsys, tmp_path, small_ct):
    """``--out`` repeated: every format is written (it used to keep the last one silently)."""
    outs = [tmp_path / "m.nii.gz", tmp_path / "m.seg.nrrd"]
    code = main(["propagate", "--volume", str(small_ct[0]), "--slice", "3", "--box", *map(str, BOX),
                 "--out", str(outs[0]), "--out", str(outs[1]), "--random-weights", "0", "--image-size", "64",
                 "--no-progress", "--json"])
    o, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(o)["outs"] == [str(p) for p in outs] and all(p.is_file() for p in outs)

"""What the command line prints, as documented: `medvol info` says in one line that it reads local
volumes when given a DICOMweb URL; a library's deprecation warning is silenced even when it is
attributed to a medvolcore module (its caller); `--resume`'s count says which cases ran now;
`timings:` names each figure and which include loading a model; `medvol propagate --qc`."""

from __future__ import annotations

import warnings

from medvolcore.cli import main

from core.dicomgen import SYNTAXES, write_series
from core.test_cli import run_cli
from core.test_dicom_generated import BOX


def test_info_says_it_reads_local_volumes(capsys):
    code, out, err = run_cli(capsys, "info", "dicomweb://127.0.0.1:8042/dicom-web/studies/1.2/series/1.2.3")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "describes a local volume" in err and "does not exist" not in err


def test_a_library_deprecation_attributed_to_medvolcore_is_silenced(capsys, monkeypatch, small_ct):
    import medvolcore.stack as stack_module

    real = stack_module.AxialStack

    def stack_that_warns(*a, **k):  # a library deprecation, attributed to its caller in medvolcore (stacklevel)
        warnings.warn_explicit("`past_key_values` is deprecated", FutureWarning, stack_module.__file__, 1,
                               module="medvolcore.stack")
        return real(*a, **k)

    monkeypatch.setattr(stack_module, "AxialStack", stack_that_warns)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code, _, err = run_cli(capsys, "info", small_ct[0])
    assert code == 0, err
    assert [str(w.message) for w in seen if issubclass(w.category, FutureWarning)] == []
    assert "past_key_values" not in err


def test_resume_counts_say_what_ran_now():
    from medvolcore.cli.batch import _text

    text = _text({"cases": 3, "done": 3, "absent": 0, "failed": 0, "invalid": 0, "skipped": 1, "ran": 2,
                  "seconds": 1.0, "failures": [], "invalid_cases": [], "summary_csv": "s.csv",
                  "summary_html": "s.html"})
    assert "3 case(s): 3 done" in text and "1 of them finished by an earlier run" in text and "2 run now" in text


def test_timings_name_what_includes_loading():
    from medvolcore.cli.volume import _timings_text

    text = _timings_text({"timings": {"ground_s": 12.5, "propagate_s": 3.25, "total_s": 15.75, "write_s": 0.5,
                                      "job_s": 17.0, "slices_encoded": 8},
                          "model_load_s": {"grounder": 10.0, "medsam2": 1.5}})
    assert text == ("timings: ground 12.50 s (loading the language model included: 10.00 s), propagate 3.25 s "
                    "(loading MedSAM2 included: 1.50 s), ground + propagate 15.75 s, write 0.50 s, job (reading the "
                    "volume, loading the models, running and writing) 17.00 s")


def test_propagate_writes_a_qc_picture(tmp_path, capsys):
    spec = {"charset": 0, "type2": {}, "blank": [], "disagree": None, "positions": "even", "rescale": "same",
            "syntax": SYNTAXES[0]}
    write_series(spec, tmp_path / "s")
    code = main([str(a) for a in ["propagate", "--volume", tmp_path / "s", "--slice", 2, "--box", *BOX,
                                  "--random-weights", 0, "--image-size", 64, "--window", 0, "--no-progress",
                                  "--out", tmp_path / "m.nii.gz", "--qc", tmp_path / "m.png"]])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "QC picture" in out

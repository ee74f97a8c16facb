"""The panel's consensus option, its confidence line and its agreement segment name (plain Python)."""

from __future__ import annotations

import pytest
from MedVolR1SlicerLib import params
from MedVolR1SlicerLib.client import Job
from MedVolR1SlicerLib.consensus import MAX_CONSENSUS, agreement_level, check_consensus, confidence_note, confidence_text
from MedVolR1SlicerLib.segments import SEGMENT_NAME_MAX, agreement_segment_name
from MedVolR1SlicerLib.session import Options, Session, segment_fields


def test_consensus_option_is_checked_and_reaches_the_request():
    assert params.options_from_panel("tiny").consensus == 1
    assert params.options_from_panel("tiny", consensus=4).consensus == 4
    for bad in (0, 9, True, "4"):
        with pytest.raises(ValueError, match="1 to 8"):
            params.options_from_panel("tiny", consensus=bad)
    off = segment_fields("/tmp/ct.nii", "the liver", Options(preset="tiny"), agreement="/tmp/a.nii.gz")
    assert "consensus" not in off and "agreement" not in off  # 1 = off: the request is what it always was
    on = segment_fields("/tmp/ct.nii", "the liver", Options(preset="tiny", consensus=3), agreement="/tmp/a.nii.gz")
    assert on["consensus"] == 3 and on["agreement"] == "/tmp/a.nii.gz"
    assert "agreement" not in segment_fields("/tmp/ct.nii", "the liver", Options(preset="tiny", consensus=3))

    sent = []

    class Client:
        def submit(self, op, **fields):
            sent.append((op, fields))
            return Job(str(len(sent)), op, fields)

    Session(client_factory=lambda o: Client()).segment("/tmp/ct.nii", "the liver", Options(preset="tiny", consensus=2),
                                                      agreement="/tmp/agr.nii.gz")
    assert [op for op, _ in sent] == ["load", "segment"] and sent[1][1]["agreement"] == "/tmp/agr.nii.gz"


def test_agreement_segment_shows_what_a_majority_of_the_answers_include():
    assert [agreement_level(g) for g in range(1, MAX_CONSENSUS + 1)] == [1, 2, 2, 3, 3, 4, 4, 5]
    assert agreement_segment_name("the liver", 3, 4) == "the liver agreement ≥ 3/4"
    long = agreement_segment_name("the kidney that contains the large cyst near the lower pole, left side", 3, 4)
    assert long.endswith("… agreement ≥ 3/4") and len(long) <= SEGMENT_NAME_MAX
    with pytest.raises(ValueError):
        check_consensus(0)


def test_confidence_lines_say_what_they_are_not():
    reply = {"confidence": 0.8333, "consensus": 4,
             "samples": [{"sample": 1, "slice": 5}, {"sample": 2, "slice": 5}, {"sample": 3, "absent": True},
                         {"sample": 4, "unusable": "no box"}]}
    text = confidence_text(reply)
    assert text.startswith("0.83: agreement of 4 answers") and "1 said not present" in text and "1 unusable" in text
    assert "not the chance that it is right" in text
    assert confidence_note(reply) == "confidence " + text
    signal = confidence_text({"answer_mean_prob": 0.912, "confidence": None})
    assert signal.startswith("answer signal 0.91") and "not the chance that it is right" in signal
    assert confidence_note({"answer_mean_prob": 0.912}) == signal
    assert confidence_text({"anchor": {}}) == "" == confidence_note({})

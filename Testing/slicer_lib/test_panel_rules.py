"""Small rules of the panel that need no Slicer: Enter in the query box, one query per line."""

from __future__ import annotations

import pytest
from MedVolR1SlicerLib.params import query_submitted


@pytest.mark.parametrize("before, after, expected", [
    ("the liver", "the liver\n", ("the liver", True)),  # Enter at the end
    ("the liver", "the\n liver", ("the liver", True)),  # Enter with the cursor inside: same query
    ("the live", "the liver", ("the liver", False)),  # a letter typed
    ("the liver", "the live", ("the live", False)),  # one deleted
    ("", "the liver\n", ("the liver\n", False)),  # a pasted line: an edit, not a request
    ("the liver", "the liver\n\n", ("the liver\n\n", False)),  # two line breaks pasted
    ("the liver\n", "the liver\nx", ("the liver\nx", False)),
])
def test_one_typed_line_break_submits_the_query_without_it(before, after, expected):
    assert query_submitted(before, after) == expected


def test_shift_enter_is_a_new_line_not_a_request():
    assert query_submitted("the liver", "the liver\n", newLine=True) == ("the liver\n", False)


@pytest.mark.parametrize("text, expected", [
    ("the liver", ["the liver"]),
    ("the liver\n\n  the  spleen \nThe Liver", ["the liver", "the spleen"]),  # blanks and a repeat left out
    ("the liver\r\nthe spleen", ["the liver", "the spleen"]),
])
def test_one_query_per_line(text, expected):
    from MedVolR1SlicerLib.session import query_lines

    assert query_lines(text) == expected


@pytest.mark.parametrize("text, message", [
    ("\n  \n", "type a query first"),
    ("\n".join(f"organ {i}" for i in range(65)), "at most 64"),
    ("the liver\n" + "x" * 2001, "keep it under 2000"),
])
def test_queries_the_worker_would_refuse_are_refused_before_sending(text, message):
    from MedVolR1SlicerLib.client import WorkerError
    from MedVolR1SlicerLib.session import Options, query_lines, segment_fields

    with pytest.raises(WorkerError, match=message):
        query_lines(text)
    with pytest.raises(WorkerError, match=message):
        segment_fields("ct.nii", text, Options())


def test_several_queries_are_one_request_with_queries_and_no_agreement_file():
    from MedVolR1SlicerLib.session import Options, segment_fields

    fields = segment_fields("ct.nii", "the liver\nthe spleen", Options(consensus=3), agreement="a.nii.gz")
    assert fields["queries"] == ["the liver", "the spleen"] and "query" not in fields
    assert fields["consensus"] == 3 and "agreement" not in fields
    assert segment_fields("ct.nii", "the liver", Options())["query"] == "the liver"

"""Small rules of the panel that need no Slicer: Enter in the query box."""

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

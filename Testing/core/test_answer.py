"""Tests for medvolcore.answer: strict parsing, listed tolerances, canonical formatting."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from medvolcore.answer import ParsedAnswer, answer_from_anchor, format_answer, parse_answer
from medvolcore.errors import AnchorError, AnswerFormatError, InputError, MedVolError

CANON = '<think>liver lesion</think><answer>[{"slice": 57, "bbox_2d_list": [[120, 300, 410, 560]]}]</answer>'

# (id, text, slice, boxes_norm, reasoning)
GOOD = [
    ("canonical", CANON, 57, [[120.0, 300.0, 410.0, 560.0]], "liver lesion"),
    ("two_boxes",
     '<think>a</think><answer>[{"slice": 0, "bbox_2d_list": [[0, 0, 1000, 1000], [1.5, 2.25, 3, 4]]}]</answer>',
     0, [[0.0, 0.0, 1000.0, 1000.0], [1.5, 2.25, 3.0, 4.0]], "a"),
    ("whitespace_everywhere",
     '  \n<think>\n  step one\n  step two \n</think>\n\n<answer>\n [ { "slice" : 3 ,\n'
     '   "bbox_2d_list" : [ [ 1 , 2 , 3 , 4 ] ] } ]\n</answer>\n',
     3, [[1.0, 2.0, 3.0, 4.0]], "step one\n  step two"),
    ("extra_field_ignored",
     '<think>r</think><answer>[{"slice": 4, "label": "liver", "bbox_2d_list": [[1, 2, 3, 4]]}]</answer>',
     4, [[1.0, 2.0, 3.0, 4.0]], "r"),
    ("spaces_inside_tags",
     '< think >r</ think>< answer >[{"slice": 1, "bbox_2d_list": [[1, 2, 3, 4]]}]< / answer >',
     1, [[1.0, 2.0, 3.0, 4.0]], "r"),
    ("text_before_and_after",
     'assistant: <think>r</think><answer>[{"slice": 9, "bbox_2d_list": [[1, 2, 3, 4]]}]</answer> done.',
     9, [[1.0, 2.0, 3.0, 4.0]], "r"),
    ("no_list_wrapper",
     '<think>r</think><answer>{"slice": 5, "bbox_2d_list": [[10, 20, 30, 40]]}</answer>',
     5, [[10.0, 20.0, 30.0, 40.0]], "r"),
    ("single_box_unwrapped",
     '<think>r</think><answer>[{"slice": 5, "bbox_2d_list": [10, 20, 30, 40]}]</answer>',
     5, [[10.0, 20.0, 30.0, 40.0]], "r"),
    ("numeric_strings",
     '<think>r</think><answer>[{"slice": "12", "bbox_2d_list": [["12", " 12.5 ", "1e2", 40]]}]</answer>',
     12, [[12.0, 12.5, 100.0, 40.0]], "r"),
    ("slice_integral_float", '<think>r</think><answer>[{"slice": 12.0, "bbox_2d_list": [[1, 2, 3, 4]]}]</answer>',
     12, [[1.0, 2.0, 3.0, 4.0]], "r"),
    ("slice_integral_float_string",
     '<think>r</think><answer>[{"slice": " 7.0 ", "bbox_2d_list": [[1, 2, 3, 4]]}]</answer>',
     7, [[1.0, 2.0, 3.0, 4.0]], "r"),
    ("inverted_box_kept", '<think>r</think><answer>[{"slice": 2, "bbox_2d_list": [[400, 500, 100, 200]]}]</answer>',
     2, [[400.0, 500.0, 100.0, 200.0]], "r"),
    ("degenerate_box_kept", '<think>r</think><answer>[{"slice": 2, "bbox_2d_list": [[5, 5, 5, 5]]}]</answer>',
     2, [[5.0, 5.0, 5.0, 5.0]], "r"),
    ("empty_reasoning", '<think></think><answer>[{"slice": 4, "bbox_2d_list": [[1, 2, 3, 4]]}]</answer>',
     4, [[1.0, 2.0, 3.0, 4.0]], ""),
    ("blank_reasoning", '<think> \n </think><answer>[{"slice": 4, "bbox_2d_list": [[1, 2, 3, 4]]}]</answer>',
     4, [[1.0, 2.0, 3.0, 4.0]], ""),
    ("field_order", '<think>r</think><answer>[{"bbox_2d_list": [[1, 2, 3, 4]], "slice": 8}]</answer>',
     8, [[1.0, 2.0, 3.0, 4.0]], "r"),
    ("unicode_reasoning", '<think>病灶 → left lobe</think><answer>[{"slice": 1, "bbox_2d_list": [[1, 2, 3, 4]]}]</answer>',
     1, [[1.0, 2.0, 3.0, 4.0]], "病灶 → left lobe"),
]


@pytest.mark.parametrize("text, z, boxes, reasoning", [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_parse_good(text, z, boxes, reasoning):
    parsed = parse_answer(text)
    assert parsed == ParsedAnswer(slice=z, boxes_norm=boxes, reasoning=reasoning, raw=text)
    assert type(parsed.slice) is int
    assert all(type(c) is float for box in parsed.boxes_norm for c in box)


def _ans(body: str, think: str = "<think>r</think>") -> str:
    return f"{think}<answer>{body}</answer>"


OK_BOX = '"bbox_2d_list": [[1, 2, 3, 4]]'

# (id, text, substring the message must contain)
BAD = [
    ("no_think", '<answer>[{"slice": 1, %s}]</answer>' % OK_BOX, "answer has no <think>…</think> block"),
    ("no_answer", "<think>r</think>", "answer has no <answer>…</answer> block"),
    ("empty_text", "", "answer has no <think>"),
    ("unclosed_think", _ans('[{"slice": 1, %s}]' % OK_BOX, "<think>r"), "no closing </think>"),
    ("unopened_think", _ans('[{"slice": 1, %s}]' % OK_BOX, "r</think>"), "no opening <think>"),
    ("unclosed_answer", '<think>r</think><answer>[{"slice": 1, %s}]' % OK_BOX, "no closing </answer>"),
    ("two_thinks", "<think>a</think><think>b</think>" + _ans('[{"slice": 1, %s}]' % OK_BOX, ""),
     "more than one <think>"),
    ("two_answers", _ans('[{"slice": 1, %s}]' % OK_BOX) + _ans('[{"slice": 2, %s}]' % OK_BOX, ""),
     "more than one <answer>"),
    ("answer_before_think", '<answer>[{"slice": 1, %s}]</answer><think>r</think>' % OK_BOX,
     "<answer> block must come after the <think>"),
    ("think_tags_reversed", '</think>r<think><answer>[{"slice": 1, %s}]</answer>' % OK_BOX, "</think> before <think>"),
    ("text_between", '<think>r</think> so: <answer>[{"slice": 1, %s}]</answer>' % OK_BOX,
     "unexpected text between </think> and <answer>"),
    ("empty_answer", _ans("  \n "), "<answer> block is empty"),
    ("not_json", _ans("slice 5, box 1 2 3 4"), "<answer> content is not valid JSON"),
    ("single_quotes", _ans("[{'slice': 1, 'bbox_2d_list': [[1, 2, 3, 4]]}]"), "not valid JSON"),
    ("trailing_comma", _ans('[{"slice": 1, "bbox_2d_list": [[1, 2, 3, 4],]}]'), "not valid JSON"),
    ("nan", _ans('[{"slice": 1, "bbox_2d_list": [[NaN, 2, 3, 4]]}]'), "NaN"),
    ("infinity", _ans('[{"slice": 1, "bbox_2d_list": [[1, 2, Infinity, 4]]}]'), "Infinity"),
    ("nan_string", _ans('[{"slice": 1, "bbox_2d_list": [["nan", 2, 3, 4]]}]'), "box 1 coordinate 'nan' is not a number"),
    ("huge_exponent", _ans('[{"slice": 1, "bbox_2d_list": [[1e999, 2, 3, 4]]}]'), "not a finite number"),
    ("duplicate_key", _ans('[{"slice": 1, "slice": 2, %s}]' % OK_BOX), "'slice' field more than once"),
    ("json_scalar", _ans("42"), "must be a list with one entry"),
    ("two_entries", _ans('[{"slice": 1, %s}, {"slice": 2, %s}]' % (OK_BOX, OK_BOX)),
     "answer lists 2 entries; exactly one key slice is expected"),
    ("entry_not_object", _ans("[[1, 2, 3, 4]]"), "answer entry must be a JSON object"),
    ("no_slice", _ans("[{%s}]" % OK_BOX), "answer entry has no 'slice' field"),
    ("no_boxes", _ans('[{"slice": 1}]'), "answer entry has no 'bbox_2d_list' field"),
    ("negative_slice", _ans('[{"slice": -3, %s}]' % OK_BOX), "slice -3 is negative"),
    ("fractional_slice", _ans('[{"slice": 12.5, %s}]' % OK_BOX), "slice 12.5 is not a whole number"),
    ("fractional_slice_string", _ans('[{"slice": "12.5", %s}]' % OK_BOX), "slice '12.5' is not a whole number"),
    ("bool_slice", _ans('[{"slice": true, %s}]' % OK_BOX), "slice true is not a number"),
    ("null_slice", _ans('[{"slice": null, %s}]' % OK_BOX), "slice is null"),
    ("word_slice", _ans('[{"slice": "five", %s}]' % OK_BOX), "slice 'five' is not a number"),
    ("empty_boxes", _ans('[{"slice": 1, "bbox_2d_list": []}]'), "bbox_2d_list is empty"),
    ("boxes_not_list", _ans('[{"slice": 1, "bbox_2d_list": "1,2,3,4"}]'), "bbox_2d_list must be a list"),
    ("mixed_boxes", _ans('[{"slice": 1, "bbox_2d_list": [[1, 2, 3, 4], 5]}]'), "mixes boxes and bare values"),
    ("three_coords", _ans('[{"slice": 1, "bbox_2d_list": [[1, 2, 3, 4], [1, 2, 3]]}]'),
     "box 2 has 3 coordinates, expected 4"),
    ("flat_five_coords", _ans('[{"slice": 1, "bbox_2d_list": [1, 2, 3, 4, 5]}]'), "box 1 has 5 coordinates, expected 4"),
    ("word_coord", _ans('[{"slice": 1, "bbox_2d_list": [["abc", 2, 3, 4]]}]'), "box 1 coordinate 'abc' is not a number"),
    ("underscore_coord", _ans('[{"slice": 1, "bbox_2d_list": [["1_0", 2, 3, 4]]}]'), "'1_0' is not a number"),
    ("bool_coord", _ans('[{"slice": 1, "bbox_2d_list": [[true, 2, 3, 4]]}]'), "box 1 coordinate true is not a number"),
    ("null_coord", _ans('[{"slice": 1, "bbox_2d_list": [[null, 2, 3, 4]]}]'), "box 1 coordinate null is not a number"),
    ("nested_coord", _ans('[{"slice": 1, "bbox_2d_list": [[[1], 2, 3, 4]]}]'), "box 1 coordinate [1] is not a number"),
    ("coord_too_big", _ans('[{"slice": 1, "bbox_2d_list": [[1, 2, 1200, 4]]}]'), "coordinate 1200 outside 0..1000"),
    ("coord_string_too_big", _ans('[{"slice": 1, "bbox_2d_list": [[1, 2, "1000.5", 4]]}]'),
     "coordinate 1000.5 outside 0..1000"),
    ("coord_negative", _ans('[{"slice": 1, "bbox_2d_list": [[1, 2, 3, 4], [-1, 2, 3, 4]]}]'),
     "box 2 coordinate -1 outside 0..1000"),
]


@pytest.mark.parametrize("text, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_parse_bad(text, message):
    with pytest.raises(AnswerFormatError) as info:
        parse_answer(text)
    assert message in str(info.value)
    assert isinstance(info.value, MedVolError)
    assert "\n" not in str(info.value)  # the CLI prints it as one line


@pytest.mark.parametrize("value", [None, b"<think></think>", 42])
def test_parse_rejects_non_text(value):
    with pytest.raises(AnswerFormatError, match="answer must be text"):
        parse_answer(value)


def test_format_canonical():
    assert format_answer(57, [[120, 300, 410, 560]], "liver lesion") == CANON


@pytest.mark.parametrize("z, boxes, reasoning", [
    (57, [[120, 300, 410, 560]], "liver lesion"),
    (0, [[0, 0, 1000, 1000], [10, 20, 30, 40], [900, 10, 50, 60]], ""),
    (311, [[1, 2, 3, 4]], "multi\nline\nreasoning with {json} and \"quotes\""),
])
def test_round_trip(z, boxes, reasoning):
    text = format_answer(z, boxes, reasoning)
    parsed = parse_answer(text)
    assert parsed.slice == z
    assert parsed.boxes_norm == [[float(c) for c in b] for b in boxes]
    assert parsed.reasoning == reasoning
    assert parsed.raw == text
    assert format_answer(parsed.slice, parsed.boxes_norm, parsed.reasoning) == text


def test_format_rounds_half_up():
    text = format_answer(3, [[12.5, 12.4, 0.5, 999.5], [1.49999, 2.5000001, 3.5, 1000.0]], "r")
    assert parse_answer(text).boxes_norm == [[13.0, 12.0, 1.0, 1000.0], [1.0, 3.0, 4.0, 1000.0]]
    assert "[[13, 12, 1, 1000], [1, 3, 4, 1000]]" in text


def test_format_accepts_flat_box_tuples_and_integral_float_slice():
    assert format_answer(57.0, (120, 300, 410, 560), "liver lesion") == CANON
    assert format_answer(57, [(120, 300, 410, 560)], "  liver lesion\n") == CANON
    assert format_answer(1, [[1, 2, 3, 4]], None).startswith("<think></think>")


@pytest.mark.parametrize("z, boxes, reasoning, message", [
    (-1, [[1, 2, 3, 4]], "", "slice -1"),
    (2.5, [[1, 2, 3, 4]], "", "slice 2.5"),
    (True, [[1, 2, 3, 4]], "", "slice True"),
    ("3", [[1, 2, 3, 4]], "", "slice '3'"),
    (1, [], "", "boxes_norm is empty"),
    (1, None, "", "boxes_norm must be a list"),
    (1, [[1, 2, 3]], "", "box 1 has 3 coordinates"),
    (1, [[1, 2, 3, 4], [1, 2, 3, 1000.6]], "", "box 2 coordinate 1000.6"),
    (1, [[1, 2, float("nan"), 4]], "", "coordinate nan"),
    (1, [[1, 2, "3", 4]], "", "coordinate '3'"),
    (1, [[1, 2, 3, 4]], "see </answer> here", "reasoning must not contain"),
    (1, [[1, 2, 3, 4]], "<think>nested", "reasoning must not contain"),
])
def test_format_rejects(z, boxes, reasoning, message):
    with pytest.raises(InputError) as info:
        format_answer(z, boxes, reasoning)
    assert message in str(info.value)


@dataclass
class FakeAnchor:
    slice: int
    boxes_norm: list
    reasoning: str = ""


def test_answer_from_anchor():
    anchor = FakeAnchor(57, [[120.4, 299.5, 410, 560]], "liver lesion")
    assert answer_from_anchor(anchor) == CANON
    overridden = parse_answer(answer_from_anchor(anchor, reasoning="other"))
    assert overridden.reasoning == "other" and overridden.slice == 57


def test_answer_from_anchor_without_reasoning_attribute():
    class Bare:
        slice = 2
        boxes_norm = [[1, 2, 3, 4]]
    assert parse_answer(answer_from_anchor(Bare())).reasoning == ""


@pytest.mark.parametrize("anchor, message", [
    (FakeAnchor(None, [[1, 2, 3, 4]]), "anchor has no 'slice'"),
    (FakeAnchor(1, None), "anchor has no 'boxes_norm'"),
    (FakeAnchor(-2, [[1, 2, 3, 4]]), "slice -2"),
    (object(), "anchor has no 'slice'"),
])
def test_answer_from_anchor_rejects(anchor, message):
    with pytest.raises(AnchorError) as info:
        answer_from_anchor(anchor)
    assert message in str(info.value)


def test_import_is_cheap():
    code = ("import sys, medvolcore.answer; "
            "heavy = {'numpy', 'torch', 'SimpleITK', 'sam2'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the absent answer ------------------------------------------------------------------------

@pytest.mark.parametrize("content", ["[]", " [ ] ", "[\n]"])
def test_empty_list_is_the_absent_answer(content):
    p = parse_answer(f"<think>no cyst on any slice</think><answer>{content}</answer>")
    assert p.absent and p.slice is None and p.boxes_norm == [] and p.reasoning == "no cyst on any slice"


@pytest.mark.parametrize("content, message", [
    ("[{}]", "no 'slice' field"),
    ('[{"slice": 3, "bbox_2d_list": []}]', "bbox_2d_list is empty"),  # an entry without boxes is not "absent"
    ("{}", "no 'slice' field"),
    ("[[]]", "must be a JSON object"),
])
def test_near_absent_answers_stay_errors(content, message):
    with pytest.raises(AnswerFormatError, match=message):
        parse_answer(f"<think></think><answer>{content}</answer>")


def test_absent_answer_round_trips_and_is_canonical():
    from medvolcore.answer import absent_answer

    text = format_answer(None, [], "  not in this CT ")
    assert text == absent_answer("not in this CT") == "<think>not in this CT</think><answer>[]</answer>"
    assert parse_answer(text).absent
    assert not parse_answer(format_answer(2, [[1, 2, 3, 4]])).absent
    with pytest.raises(InputError, match="absent answer .* has no boxes"):
        format_answer(None, [[1, 2, 3, 4]])

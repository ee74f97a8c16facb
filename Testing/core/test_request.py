"""The segment request, declared once (:mod:`medvolcore.request`, with :mod:`medvolcore.result` for what
each field's declaration says of the result): each door's builder, the field names each door's
errors use, and each rule's message written in one place of ``medvolcore``. No model is loaded here.
The result's own declaration is test_result.py's."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from medvolcore.cli.app import build_parser
from medvolcore.errors import FieldError, InputError
from medvolcore.request import MAX_TARGETS, SegmentRequest
from medvolcore.result import ENTRY, ONE, SEVERAL, SegmentResult

MEDVOLCORE = Path(__file__).resolve().parents[2] / "MedVolCore" / "medvolcore"
BOX = [20, 20, 70, 60]


def cli_args(*argv):
    return build_parser().parse_args([str(a) for a in argv])


def segment_args(*extra):
    return cli_args("segment", "--volume", "ct.nii.gz", "--out", "m.nii.gz", *extra)


# ---- the builders ------------------------------------------------------------------------------

def test_from_cli_reads_each_declared_option_of_the_command():
    args = segment_args("--ct-window", "lung", "--stop-after-empty", "0", "--no-constrain", "--seed", "7",
                        "--consensus", "3", "--consensus-mask", "majority", "--target-name", "liver")
    r = SegmentRequest.from_cli(args, query="  the liver ")
    assert (r.query, r.hu_window, r.stop_after_empty, r.constrain, r.seed) == ("the liver", "lung", 0, False, 7)
    assert (r.consensus, r.consensus_mask, r.target_name, r.sample, r.door) == (3, "majority", "liver", False, "cli")
    assert r.anchor is None and r.span is None  # segment has neither --anchor nor propagate's --window
    p = SegmentRequest.from_cli(cli_args("propagate", "--volume", "ct.nii.gz", "--out", "m.nii.gz", "--slice", 4,
                                         "--box", *BOX, "--window", 3, "--z-range", 2, 6, "--largest-component",
                                         "--add-box", 5, 1, *BOX, "--random-weights", 0))
    assert (p.key_slice, p.boxes, p.span, p.z_range, p.largest_component) == (4, [BOX], 3, [2, 6], True)
    assert p.prompts == [{"slice": 5, "object": 1, "box": BOX, "points": []}] and p.constrain is True
    several = SegmentRequest.from_cli(segment_args(), queries=["the liver", "the spleen"])
    assert several.queries == ["the liver", "the spleen"] and several.query is None and several.targets == 2


def test_from_wire_reads_each_declared_key_of_the_op_and_leaves_the_rest():
    r = SegmentRequest.from_wire({"id": 1, "op": "segment", "volume": "ct.nii.gz", "query": " the liver",
                                  "window": [40, 400], "stop_after_empty": 0, "seed": 5, "constrain": False,
                                  "consensus": 2, "consensus_mask": "majority", "target_name": "liver",
                                  "out": "m.nii.gz", "preset": "tiny", "a_key_from_a_newer_client": [1]})
    assert (r.query, r.hu_window, r.stop_after_empty, r.seed, r.constrain) == ("the liver", (40, 400), 0, 5, False)
    assert (r.consensus, r.consensus_mask, r.target_name, r.door) == (2, "majority", "liver", "wire")
    anchor = {"schema": "medvol.anchor/1", "slice": 3, "boxes": [BOX]}
    p = SegmentRequest.from_wire({"op": "propagate", "volume": "v", "anchor": anchor, "window": "lung",
                                  "query": "ignored by propagate", "seed": "not read by propagate either"})
    assert p.anchor == anchor and p.query is None and p.seed is None and p.hu_window == "lung" and not p.grounded
    nulls = SegmentRequest.from_wire({"op": "segment", "query": "liver", "consensus": None, "seed": None})
    assert nulls.consensus == 1 and nulls.seed is None  # null is "not given", as protocol 1 always read it
    one = SegmentRequest.from_wire({"op": "segment", "queries": ["the liver"]})
    assert one.query == "the liver" and one.queries is None  # a list of one is one query


@pytest.mark.parametrize("req, code, message", [
    ({"query": "x", "seed": "abc"}, "bad_request", "segment: field 'seed' must be an integer, got str"),
    ({"query": "x", "sample": 1}, "bad_request", "segment: field 'sample' must be true/false, got int"),
    ({"query": "x", "seed": 2 ** 70}, "bad_request", "segment: field 'seed' is out of range"),
    ({"query": "x", "window": [1, 2, 3]}, "bad_request", "segment: field 'window' must be a preset name or [centre"),
    ({"query": "x", "window": 5}, "bad_request", "segment: field 'window' must be a string or a list, got int"),
    ({}, "bad_request", "segment: missing field 'query' (or 'queries': a list of them, one target each)"),
    ({"queries": "the liver"}, "bad_request", "segment: field 'queries' must be a list, got str"),
    ({"queries": []}, "bad_request", "segment: field 'queries' must be a non-empty list of strings"),
    ({"queries": ["a", 3]}, "bad_request", "segment: field 'queries' must be a non-empty list of strings"),
    ({"queries": ["a\ud800"]}, "bad_input", "segment: field 'queries' holds text that is not valid Unicode"),
    ({"query": "liver \ud800"}, "bad_input", "segment: field 'query' is not valid Unicode text"),
    ({"query": "a", "queries": ["b", "c"]}, "bad_request", "segment: give 'query' or 'queries', not both"),
    ({"query": "   "}, "bad_input", "segment: the query is empty"),
    ({"queries": ["The liver", "the  liver"]}, "bad_input", "'queries': query 2 repeats query 1"),
    ({"query": "x", "consensus": 9}, "bad_request", "segment: 'consensus' must be a whole number from 1 to 8"),
    ({"query": "x", "consensus_mask": "mean"}, "bad_request", "'consensus_mask' must be one of greedy, majority"),
    ({"query": "x", "consensus_mask": "majority"}, "bad_request", "'consensus_mask' majority needs 'consensus' from 2"),
    ({"query": "x", "agreement": "a.nii.gz"}, "bad_request", "segment: 'agreement' writes the agreement of a consensus"),
    ({"query": "x", "consensus": 2, "sample": True}, "bad_request",
     "segment: 'sample' and 'consensus' do not go together"),
    ({"query": "x", "stop_after_empty": -1}, "bad_request", "segment: 'stop_after_empty' must be an integer number"),
    ({"query": "x", "stop_after_empty": "3"}, "bad_request", "segment: field 'stop_after_empty' must be an integer"),
    ({"query": "x", "target_name": " "}, "bad_request", "segment: 'target_name' must be a short text"),
    ({"queries": ["a", "b"], "target_name": "liver"}, "bad_request", "'target_name' names one target"),
    ({"op": "propagate"}, "bad_request", "propagate: missing field 'anchor' (a medvol.anchor/1, /2 or /4 object)"),
    ({"op": "propagate", "anchor": {}, "consensus": 2}, "bad_request",
     "propagate: 'consensus' asks for a consensus of the model's answers to a query; a given anchor has none"),
])
def test_from_wire_refuses_as_the_worker_always_did(req, code, message):
    with pytest.raises(InputError) as e:
        SegmentRequest.from_wire({"id": 3, "op": "segment", "volume": "ct.nii.gz", **req})
    assert e.value.code == code and message in str(e.value), str(e.value)


def test_from_manifest_reads_a_row_and_the_runs_options():
    row = {"id": "case7", "volume": "ct/case7.nii.gz", "query": " the spleen ", "gt": "", "label": None}
    r = SegmentRequest.from_manifest(row, hu_window="lung", stop_after_empty=0, consensus=2, seed=4, reference=None)
    assert (r.query, r.hu_window, r.stop_after_empty, r.consensus, r.seed) == ("the spleen", "lung", 0, 2, 4)
    assert r.qc_title == "case7 · query: the spleen" and r.door == "manifest" and r.grounded
    assert SegmentRequest.from_manifest(row, qc_title="mine").qc_title == "mine"
    with pytest.raises(InputError, match="the query is empty"):
        SegmentRequest.from_manifest(dict(row, query="  "))
    with pytest.raises(FieldError, match="give 'query' to segment"):  # the column, as the manifest names it
        SegmentRequest.from_manifest({"id": "c", "volume": "v.nii.gz"})
    with pytest.raises(FieldError, match="^--sample and --consensus do not go together"):  # medvol batch's options
        SegmentRequest.from_manifest(row, sample=True, consensus=3)


# ---- one rule, each door's names -----------------------------------------------------------------

def _error(build):
    with pytest.raises(InputError) as e:
        build()
    return str(e.value)


@pytest.mark.parametrize("api, cli, wire, manifest, expected", [
    (dict(stop_after_empty=-2), ["--stop-after-empty", "-2"], {"stop_after_empty": -2}, dict(stop_after_empty=-2),
     ("stop_after_empty must be an integer number of slices ≥ 0", "--stop-after-empty must be an integer number",
      "segment: 'stop_after_empty' must be an integer number", "--stop-after-empty must be an integer number")),
    (dict(sample=True, consensus=2), ["--sample", "--consensus", "2"], {"sample": True, "consensus": 2},
     dict(sample=True, consensus=2),
     ("sample and consensus do not go together", "--sample and --consensus do not go together",
      "segment: 'sample' and 'consensus' do not go together", "--sample and --consensus do not go together")),
    (dict(consensus=0), ["--consensus", "0"], {"consensus": 0}, dict(consensus=0),
     ("consensus must be a whole number from 1 to 8", "--consensus must be a whole number from 1 to 8",
      "segment: 'consensus' must be a whole number from 1 to 8", "--consensus must be a whole number from 1 to 8")),
    (dict(consensus_mask="majority"), ["--consensus-mask", "majority"], {"consensus_mask": "majority"},
     dict(consensus_mask="majority"),
     ("consensus_mask majority needs consensus from 2 to 8", "--consensus-mask majority needs --consensus from 2 to 8",
      "segment: 'consensus_mask' majority needs 'consensus' from 2 to 8",
      "--consensus-mask majority needs --consensus from 2 to 8")),
    (dict(target_name=""), ["--target-name", ""], {"target_name": ""}, dict(target_name=""),
     ("the target name must be a short text", "--target-name must be a short text",
      "segment: 'target_name' must be a short text", "--target-name must be a short text")),
])
def test_each_door_names_the_fields_as_its_users_know_them(api, cli, wire, manifest, expected):
    got = (_error(lambda: SegmentRequest(query="liver", **api).check()),
           _error(lambda: SegmentRequest.from_cli(segment_args(*cli), query="liver")),
           _error(lambda: SegmentRequest.from_wire({"op": "segment", "query": "liver", **wire})),
           _error(lambda: SegmentRequest.from_manifest({"id": "c", "query": "liver"}, **manifest)))
    for text, start in zip(got, expected):
        assert text.startswith(start), (text, start)


def test_the_agreement_rule_names_the_doors_output():
    assert _error(lambda: SegmentRequest(query="liver").check(agreement="agreement.nii.gz")).startswith(
        "agreement.nii.gz writes the agreement of a consensus: add consensus G")
    assert _error(lambda: SegmentRequest.from_cli(segment_args("--agreement", "a.nii.gz"), query="liver")).startswith(
        "--agreement writes the agreement of a consensus: add --consensus G (G from 2 to 8)")


@pytest.mark.parametrize("argv, message", [
    (["--slice", 3, "--box", *BOX, "--window", -1], "--window must be a whole number of slices ≥ 0, got -1"),
    (["--anchor", "a.anchor.json", "--slice", 3, "--box", *BOX], "give either --anchor or --slice with --box, not both"),
    (["--slice", 3], "--slice needs one or more --box, and --box need --slice"),
    ([], "give --query to segment, or --anchor (or --slice with --box) to propagate"),
])
def test_propagate_options_are_checked_by_the_request(argv, message):
    args = cli_args("propagate", "--volume", "ct.nii.gz", "--out", "m.nii.gz", "--random-weights", 0, *argv)
    assert _error(lambda: SegmentRequest.from_cli(args)) == message


def test_a_request_built_in_python_is_checked_by_the_job_not_on_construction():
    r = SegmentRequest()  # the job refuses it, before anything is read (test_jobs.py)
    with pytest.raises(FieldError, match="give a query to segment, or an anchor"):
        r.check()
    with pytest.raises(FieldError, match=f"at most {MAX_TARGETS} queries"):
        SegmentRequest(queries=[f"q{i}" for i in range(MAX_TARGETS + 1)]).check()
    with pytest.raises(FieldError, match="a reference mask scores one target"):
        SegmentRequest(queries=["a", "b"], reference=object()).check()


def test_every_field_declares_a_description_and_the_doors_names_that_exist():
    parser_dests = set(vars(segment_args())) | set(vars(cli_args("propagate", "--volume", "v", "--out", "m",
                                                                 "--random-weights", 0)))
    for f in fields(SegmentRequest):
        if f.name == "door":
            continue
        m = f.metadata
        assert m["doc"], f.name
        if m["dest"]:
            assert m["dest"] in parser_dests, (f.name, m["dest"])
    for f in fields(SegmentResult):
        assert f.metadata["doc"] and set(f.metadata["shapes"]) <= {ONE, SEVERAL, ENTRY}, f.name


# ---- one place for each rule ---------------------------------------------------------------------

RULES = [  # (what, a fragment of its message, as written in the source)
    ("sample vs consensus", "do not go together: a consensus samples its own"),
    ("a consensus's size", "(1 = the greedy answer alone)"),
    ("the consensus mask's values", "must be one of {', '.join(MASK_MODES)}"),
    ("a mask mode needs a consensus", "(a consensus of that many answers)"),
    ("an agreement map needs a consensus", "writes the agreement of a consensus"),
    ("a consensus needs a query", "asks for a consensus of the model's answers"),
    ("early stop's K", "number of slices ≥ 0 (0 = never stop early)"),
    ("query vs queries", "or {n('queries')}, not both"),
    ("anchor vs key slice", "give either"),
    ("a key slice needs boxes", "needs one or more"),
    ("a query or an anchor", "to segment, or"),
    ("corrections need an anchor", "apply to a given anchor"),
    ("the target name's text", "must be a short text"),
    ("one target name", "names one target"),
    ("queries are grounded", "a given anchor has one target"),
    ("a repeated query", "give each target once"),
    ("the slice span", "must be a whole number of slices ≥ 0"),
    ("a reference scores one target", "scores one target; score several"),
    ("the wire's window", "must be a preset name or [centre, width] in HU"),
    ("a wire field's type", "must be {names}, got"),
]


@pytest.mark.parametrize("what, fragment", RULES, ids=[r[0] for r in RULES])
def test_each_rule_is_written_once_in_medvolcore(what, fragment):
    found = []
    for path in sorted(MEDVOLCORE.rglob("*.py")):
        count = path.read_text(encoding="utf-8").count(fragment)
        found += [f"{path.relative_to(MEDVOLCORE)}:{count}"] if count else []
    assert len(found) == 1 and found[0].endswith(":1"), (what, found)

"""Which segment am I working on: generated sequences of a clinician's actions on real MRML
(slicer-core), with the module's logic, checked after every step (a Hypothesis
``RuleBasedStateMachine``).

The actions: load or switch the volume, Segment (one query or several), move a box, add a box or
a point on another slice, paint voxels of any segment, switch the Output segmentation to another
one or to none, create an empty one, clone one (same segment IDs, as the Data module does),
delete one, select another segment (the panel's list or the Segment Editor, one logic call),
delete a segment, Re-propagate, Undo, Redo, close the scene while a request runs.

The invariants, after every step:

- the evidence shown belongs to the selected segment of the selected segmentation (a segment that
  exists), or none is shown;
- a result lands in one segment only: for Re-propagate, the one whose evidence was sent, in the
  segmentation that holds it; no other segment's voxels change; a refused Re-propagate writes
  nothing;
- Undo puts back exactly what the result changed, Redo puts it back again, nothing else changes;
- no evidence node refers to a segmentation that is gone or to a segment that does not exist
  (unless it was deleted after the evidence was written: Segment Editor's own Undo brings it back);
- nothing of a closed scene reaches the next one.

The worker is the tier's :class:`ManualClient`, answering with what the real worker returns for
the real label map (8 slices of the upper-abdomen CT). The default run is small (the fast tier's
time); ``MEDVOL_STATEFUL_EXAMPLES=500`` runs more (docs/slicer.md, "What is tested")."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
hypothesis = pytest.importorskip("hypothesis")
import slicer  # noqa: E402 - the real package, imported by conftest.py
from hypothesis import HealthCheck, Phase, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test  # noqa: E402
from test_mrml_clinician_day import ManualClient, SINGLE_FILE  # noqa: E402
from test_mrml_logic import worker_result  # noqa: E402

EXAMPLES = int(os.environ.get("MEDVOL_STATEFUL_EXAMPLES", "12"))
SAVE = os.environ.get("MEDVOL_STATEFUL_SAVE", "1") != "0"  # 0: no save-and-reopen steps (faster)
SHRINK = os.environ.get("MEDVOL_STATEFUL_SHRINK", "1") != "0"  # 0: report the first failing sequence as found
STEPS = int(os.environ.get("MEDVOL_STATEFUL_STEPS", "14"))
QUERIES = {"the liver": [5], "the spleen": [1], "the right kidney": [2], "the stomach": [6]}
EVIDENCE_ATTR = "MedVolR1.evidence"  # evidence.EVIDENCE_ATTR


def segmentations():
    return [n for n in slicer.util.getNodesByClass("vtkMRMLSegmentationNode")]


def masks_of(volume):
    """Every segment of every segmentation: ``{(segmentation ID, segment ID): mask}``."""
    found = {}
    for seg in segmentations():
        s = seg.GetSegmentation()
        for i in range(s.GetNumberOfSegments()):
            sid = s.GetNthSegmentID(i)
            found[(seg.GetID(), sid)] = slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume).astype(bool)
    return found


def changed(before: dict, after: dict) -> set:
    keys = set(before) | set(after)
    return {k for k in keys if (k in before) != (k in after)
            or (k in before and not np.array_equal(before[k], after[k]))}


RUNS = []  # one entry per generated sequence (the examples a run needed)


def make_machine(env, small_ct, tmp_path):
    import nibabel as nib

    from MedVolR1SlicerLib.client import WorkerError
    from MedVolR1SlicerLib.session import Options, Session

    ct_path, seg_path = small_ct
    labels = np.asarray(nib.load(str(seg_path)).dataobj).astype(np.uint8)
    tiny = Options(preset="tiny", device="cpu")
    counter = iter(range(10 ** 9))

    class WorkingSegment(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            RUNS.append(1)
            slicer.mrmlScene.Clear(0)
            self.client = ManualClient()
            self.logic = env.MedVolR1SlicerLogic(session=Session(client_factory=lambda options: self.client))
            self.volumes = [self._load("CT")]
            self.p.inputVolume = self.volumes[0]
            self.owner = {}  # evidence tag (the answer's reasoning) -> (segmentation ID, segment ID)
            self.undos, self.redos = {}, {}  # segmentation ID -> [(before masks, after masks)] of its changed segments
            self.deleted = set()  # (segmentation ID, segment ID) deleted after their evidence was written
            self.generation = 0

        def teardown(self):
            self.logic.cleanup()
            slicer.mrmlScene.Clear(0)

        @property
        def p(self):
            return self.logic.getParameterNode()

        def _load(self, name):
            node = slicer.modules.volumes.logic().AddArchetypeVolume(str(ct_path), name, SINGLE_FILE)
            assert node is not None
            return node

        def _answer(self, job, volume, label_ids, query):
            tag = f"r{next(counter)}"
            result, mask, _ = worker_result(self.logic, volume, labels, label_ids, tmp_path,
                                            name=f"{tag}.nii.gz", query=query)
            result["anchor"]["reasoning"] = tag
            return tag, result, mask

        def _record(self, before, after, segId):
            """A result changed ``segId``'s segments: push its Undo step in the model."""
            keys = {k for k in changed(before, after) if k[0] == segId}
            self.undos.setdefault(segId, []).append(({k: before.get(k) for k in keys}, {k: after.get(k) for k in keys}))
            self.redos[segId] = []

        # ---- actions -------------------------------------------------------------------------

        @precondition(lambda self: len(self.volumes) < 2)
        @rule()
        def load_second_volume(self):
            self.volumes.append(self._load("CT2"))

        @rule(i=st.integers(0, 1))
        def switch_volume(self, i):
            self.p.inputVolume = self.volumes[i % len(self.volumes)]

        @rule(queries=st.lists(st.sampled_from(sorted(QUERIES)), min_size=1, max_size=2, unique=True))
        def segment(self, queries):
            p = self.p
            volume = p.inputVolume
            p.query = "\n".join(queries)
            before = masks_of(volume)
            job = self.logic.startSegment(p, tiny)
            if len(queries) == 1:
                tag, result, mask = self._answer(job, volume, QUERIES[queries[0]], queries[0])
                tags, masks = [tag], [mask]
            else:  # several queries: one label map, one entry per query
                tags, masks, entries = [], [], []
                label_map = np.zeros_like(labels)
                for i, q in enumerate(queries):
                    tag, r, m = self._answer(job, volume, QUERIES[q], q)
                    tags.append(tag)
                    masks.append(m)
                    label_map[m > 0] = i + 1
                    entries.append({"query": q, "anchor": r["anchor"], "label": i + 1})
                from medvolcore.volume import load_volume, save_mask
                path = save_mask(label_map, load_volume(job.request["volume"]), tmp_path / f"l{next(counter)}.nii.gz")
                result = {"targets": entries, "mask_path": str(path), "notes": [], "smoke": False}
            self.client.answer(job, result)
            assert job.state == "done", job.error
            after = masks_of(volume)
            diff = changed(before, after)
            assert len(diff) == len(queries), diff  # one segment per query, nothing else touched
            for tag, mask in zip(tags, masks):
                (key,) = [k for k in diff if np.array_equal(after.get(k), np.transpose(mask, (2, 1, 0)) > 0)]
                self.owner[tag] = key
            self._record(before, after, next(iter(diff))[0])

        @rule(dx=st.floats(-8, 8), dy=st.floats(-8, 8))
        def move_box(self, dx, dy):
            p = self.p
            boxes = [b for b in p.boxes if b is not None]
            if not boxes or self.logic.resultProblem(p):
                return
            c = [0.0, 0.0, 0.0]
            boxes[0].GetCenter(c)
            boxes[0].SetCenter(c[0] + dx, c[1] + dy, c[2])
            p.boxesEdited = True  # what the panel's box observer does

        @rule(up=st.booleans(), point=st.booleans())
        def correct_another_slice(self, up, point):
            p = self.p
            if self.logic.resultProblem(p):
                return
            geo = self.logic.geometry(p.resultVolume)
            k = p.keySliceIJK + (1 if up else -1)
            if not 0 <= k < geo.shape[2]:
                k = p.keySliceIJK - (1 if up else -1)
            ras = [float(v) for v in geo.slice_center_ras(k)]
            if point:
                self.logic.addPoint(p, ras, positive=True, objectNumber=1)
            else:
                self.logic.addBoxHere(p, objectNumber=1, sliceIndex=k, ras=ras)

        @rule(which=st.integers(0, 20), value=st.booleans())
        def paint(self, which, value):
            volume = self.volumes[0]
            keys = sorted(masks_of(volume))
            if not keys:
                return
            segId, sid = keys[which % len(keys)]
            seg = slicer.mrmlScene.GetNodeByID(segId)
            arr = slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume).copy()
            arr[4, 40:44, 40:44] = 1 if value else 0
            slicer.util.updateSegmentBinaryLabelmapFromArray(arr, seg, sid, volume)

        @rule(which=st.integers(-1, 5))
        def choose_output(self, which):
            """The Output selector: the user picks another segmentation (or none)."""
            segs = segmentations()
            self.p.outputSegmentation = None if which < 0 or not segs else segs[which % len(segs)]

        @rule()
        def create_output(self):
            """"Create new segmentation" in the selector's menu: a new empty node, selected."""
            node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", "Segmentation")
            node.CreateDefaultDisplayNodes()
            self.p.outputSegmentation = node

        @rule(which=st.integers(0, 5), select=st.booleans())
        def clone_output(self, which, select):
            """The Data module's Clone: the same segments, with the same IDs, in a new node."""
            segs = segmentations()
            if not segs:
                return
            source = segs[which % len(segs)]
            node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", source.GetName() + " copy")
            node.CreateDefaultDisplayNodes()
            node.GetSegmentation().DeepCopy(source.GetSegmentation())
            if select:
                self.p.outputSegmentation = node

        @rule(which=st.integers(0, 5), neighbour=st.booleans())
        def delete_output(self, which, neighbour):
            """A segmentation deleted (Data module); ``neighbour``: the selector then moves to the
            next one, as Qt's combo box does when its current item is removed."""
            segs = segmentations()
            if not segs:
                return
            node = segs[which % len(segs)]
            current = self.p.outputSegmentation is node
            slicer.mrmlScene.RemoveNode(node)
            self.undos.pop(node.GetID(), None)
            self.redos.pop(node.GetID(), None)
            rest = segmentations()
            if current and neighbour and rest:
                self.p.outputSegmentation = rest[min(which % len(segs), len(rest) - 1)]

        @rule(which=st.integers(0, 20))
        def select_segment(self, which):
            """The panel's segment list, or the Segment Editor's selection (one logic call)."""
            seg = self.p.outputSegmentation
            if seg is None or seg.GetSegmentation().GetNumberOfSegments() == 0:
                return
            s = seg.GetSegmentation()
            self.logic.selectSegment(self.p, seg, s.GetNthSegmentID(which % s.GetNumberOfSegments()))

        @rule(which=st.integers(0, 20))
        def delete_segment(self, which):
            """A segment deleted in the Segment Editor."""
            segs = segmentations()
            if not segs:
                return
            seg = segs[which % len(segs)]
            s = seg.GetSegmentation()
            if s.GetNumberOfSegments() == 0:
                return
            sid = s.GetNthSegmentID(which % s.GetNumberOfSegments())
            s.RemoveSegment(sid)
            self.deleted.add((seg.GetID(), sid))

        @rule(label=st.sampled_from(sorted(QUERIES)))
        def repropagate(self, label):
            p = self.p
            shown = p.reasoning if p.anchorJson else ""
            volume = p.resultVolume
            if not shown or volume is None or self.logic.resultProblem(p) or not list(p.boxes):
                return
            sent = self.owner.get(shown)
            before = masks_of(volume)
            try:
                job, _ = self.logic.startRepropagate(p, tiny)
            except (WorkerError, ValueError):
                assert changed(before, masks_of(volume)) == set()
                return
            tag, result, mask = self._answer(job, volume, QUERIES[label], label)
            self.client.answer(job, result)
            after = masks_of(volume)
            diff = changed(before, after)
            if job.state != "done":  # refused: nothing written
                assert diff == set(), diff
                return
            assert diff <= {sent}, (diff, sent)  # only the segment whose evidence was sent
            assert sent in after and np.array_equal(after[sent], np.transpose(mask, (2, 1, 0)) > 0)
            self.owner[tag] = sent
            if diff:
                self._record(before, after, sent[0])

        def _undo_or_redo(self, undo):
            seg = self.p.outputSegmentation
            segId = seg.GetID() if seg is not None else ""
            stack, other = (self.undos, self.redos) if undo else (self.redos, self.undos)
            volume = self.volumes[0]
            before = masks_of(volume)
            action = self.logic.undoLastResult if undo else self.logic.redoLastResult
            done = action(discardEdits=True)
            assert done == bool(stack.get(segId)), (done, segId, stack.get(segId))
            after = masks_of(volume)
            if not done:
                assert changed(before, after) == set()
                return
            was, will = stack[segId].pop()
            target, source = (was, will) if undo else (will, was)
            for key, mask in target.items():
                assert (key in after) == (mask is not None), key
                if mask is not None:
                    assert np.array_equal(after[key], mask), key
            assert changed(before, after) <= set(target), changed(before, after) - set(target)
            other.setdefault(segId, []).append((was, will))

        @rule()
        def undo(self):
            self._undo_or_redo(True)

        @rule()
        def redo(self):
            self._undo_or_redo(False)

        @rule(which=st.integers(0, 5))
        def rename_output(self, which):
            """A segmentation renamed (Data module): nothing of the selection changes."""
            segs = segmentations()
            if segs:
                shown = (self.p.segmentId, self.p.anchorJson)
                segs[which % len(segs)].SetName(f"renamed {next(counter)}")
                assert (self.p.segmentId, self.p.anchorJson) == shown

        @precondition(lambda self: SAVE)
        @rule()
        def save_and_reopen(self):
            """The scene saved as a data bundle and opened again (File > Load scene)."""
            folder = tmp_path / f"bundle{next(counter)}"
            folder.mkdir()
            logic = slicer.modules.volumes.logic().GetApplicationLogic()
            assert logic.SaveSceneToSlicerDataBundleDirectory(str(folder), None)
            (mrml,) = folder.glob("*.mrml")
            ids = {n.GetID(): n.GetName() for n in segmentations() + self.volumes}
            slicer.mrmlScene.Clear(0)
            slicer.mrmlScene.SetURL(str(mrml))
            assert slicer.mrmlScene.Import()
            assert {n.GetID(): n.GetName() for n in segmentations()} == \
                {i: name for i, name in ids.items() if i.startswith("vtkMRMLSegmentationNode")}
            self.volumes = [slicer.mrmlScene.GetNodeByID(v.GetID()) for v in self.volumes]
            self.undos, self.redos = {}, {}  # the session's Undo ends with the scene

        @rule(query=st.sampled_from(sorted(QUERIES)))
        def close_scene_mid_run(self, query):
            p = self.p
            p.query = query
            volume = p.inputVolume
            job = self.logic.startSegment(p, tiny)
            _, result, _ = self._answer(job, volume, QUERIES[query], query)
            slicer.mrmlScene.Clear(0)
            self.client.answer(job, result)
            assert job.state == "cancelled"
            assert segmentations() == [] and not self.logic.canUndo
            self.volumes = [self._load("CT")]
            self.owner, self.undos, self.redos, self.deleted = {}, {}, {}, set()
            self.p.inputVolume = self.volumes[0]

        # ---- invariants ----------------------------------------------------------------------

        @invariant()
        def evidence_shown_is_the_selected_segments(self):
            p = self.p
            if not p.anchorJson:
                return
            seg = p.outputSegmentation
            assert seg is not None, "evidence shown with no output segmentation"
            assert seg.GetSegmentation().GetSegment(p.segmentId) is not None, \
                f"evidence shown for {p.segmentId!r}, not a segment of {seg.GetName()}"
            assert self.owner.get(p.reasoning) == (seg.GetID(), p.segmentId), \
                f"the evidence shown ({p.reasoning}) is {self.owner.get(p.reasoning)}'s, the selection is " \
                f"{(seg.GetID(), p.segmentId)}"

        @invariant()
        def evidence_nodes_refer_to_what_exists(self):
            for node in slicer.util.getNodesByClass("vtkMRMLScriptedModuleNode"):
                if node.GetAttribute(EVIDENCE_ATTR) is None:
                    continue
                seg = node.GetNodeReference("segmentation")
                assert seg is not None and seg.GetScene() is not None, "evidence of a segmentation that is gone"
                sid = node.GetParameter("segmentId")
                assert seg.GetSegmentation().GetSegment(sid) is not None or (seg.GetID(), sid) in self.deleted, \
                    f"an evidence node for {sid!r}, which {seg.GetName()} never had"

    phases = list(Phase) if SHRINK else [Phase.explicit, Phase.reuse, Phase.generate]
    WorkingSegment.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                                derandomize=True, database=None, phases=phases,
                                                suppress_health_check=list(HealthCheck),
                                                print_blob=False)
    return WorkingSegment


def test_generated_sequences_keep_one_answer_to_which_segment_is_worked_on(slicer_env, small_ct, tmp_path):
    machine = make_machine(slicer_env, small_ct, tmp_path)
    RUNS.clear()
    try:
        run_state_machine_as_test(machine, settings=machine.TestCase.settings)
    finally:
        print(f"\n{len(RUNS)} generated sequences of at most {STEPS} steps")


def test_a_second_logic_on_the_scene_does_not_undo_what_the_first_shows(slicer_env, small_ct, tmp_path):
    """Every logic of the module (the panel's, the self-test's, one a script made) follows the same
    parameter node: none may act on the half-written selection another one is writing."""
    import nibabel as nib

    from MedVolR1SlicerLib.session import Options, Session

    slicer.mrmlScene.Clear(0)
    client = ManualClient()
    first = slicer_env.MedVolR1SlicerLogic(session=Session(client_factory=lambda options: client))
    second = slicer_env.MedVolR1SlicerLogic(session=Session(client_factory=lambda options: ManualClient()))
    try:
        ct_path, seg_path = small_ct
        labels = np.asarray(nib.load(str(seg_path)).dataobj).astype(np.uint8)
        volume = slicer.modules.volumes.logic().AddArchetypeVolume(str(ct_path), "CT", SINGLE_FILE)
        p = first.getParameterNode()
        second.getParameterNode()
        p.inputVolume, p.query = volume, "the liver"
        job = first.startSegment(p, Options(preset="tiny", device="cpu"))
        result, _, _ = worker_result(first, volume, labels, QUERIES["the liver"], tmp_path)
        client.answer(job, result)
        assert job.state == "done", job.error
        assert p.segmentId and p.outputSegmentation.GetSegmentation().GetSegment(p.segmentId) is not None
        assert json.loads(p.anchorJson)["query"] == "the liver" and len(p.boxes) == 1
    finally:
        second.cleanup()
        first.cleanup()
        slicer.mrmlScene.Clear(0)


def test_repropagate_writes_nothing_when_its_segment_is_removed_while_the_worker_runs(slicer_env, small_ct, tmp_path):
    """The segment whose evidence was sent is deleted (Segment Editor) before the answer comes:
    one line, nothing written anywhere, and no evidence left on screen for it."""
    import nibabel as nib

    from MedVolR1SlicerLib.session import Options, Session

    slicer.mrmlScene.Clear(0)
    client = ManualClient()
    logic = slicer_env.MedVolR1SlicerLogic(session=Session(client_factory=lambda options: client))
    try:
        ct_path, seg_path = small_ct
        labels = np.asarray(nib.load(str(seg_path)).dataobj).astype(np.uint8)
        volume = slicer.modules.volumes.logic().AddArchetypeVolume(str(ct_path), "CT", SINGLE_FILE)
        p = logic.getParameterNode()
        p.inputVolume, p.query = volume, "the liver"
        tiny = Options(preset="tiny", device="cpu")
        job = logic.startSegment(p, tiny)
        client.answer(job, worker_result(logic, volume, labels, QUERIES["the liver"], tmp_path, name="a.nii.gz")[0])
        p.query = "the spleen"
        job = logic.startSegment(p, tiny)
        client.answer(job, worker_result(logic, volume, labels, QUERIES["the spleen"], tmp_path, name="b.nii.gz",
                                         query="the spleen")[0])
        seg, spleen = p.outputSegmentation, p.segmentId
        p.boxesEdited = True
        job, _ = logic.startRepropagate(p, tiny)
        before = masks_of(volume)
        seg.GetSegmentation().RemoveSegment(spleen)
        assert p.anchorJson == "" and p.segmentId == ""  # followed at once: nothing shown for a segment gone
        client.answer(job, worker_result(logic, volume, labels, QUERIES["the liver"], tmp_path, name="c.nii.gz")[0])
        assert job.state == "cancelled" and "was removed" in job.error.message and "nothing was written" in job.error.message
        after = masks_of(volume)
        assert set(after) == set(before) - {(seg.GetID(), spleen)}
        assert all(np.array_equal(after[k], before[k]) for k in after)
        with pytest.raises(ValueError, match="segment first"):  # and nothing to send now
            logic.startRepropagate(p, tiny)
    finally:
        logic.cleanup()
        slicer.mrmlScene.Clear(0)

"""Which segment am I working on, through the real-Qt panel: generated sequences of what a user
does with the panel's own widgets (a Hypothesis ``RuleBasedStateMachine``, smaller than the
logic's in ``Testing/slicer_mrml/test_mrml_working_segment.py``).

The actions: Segment (a query already in the segmentation answered "Keep both" or closed with
Esc), pick another Output segmentation or none in its selector, "Create new segmentation",
"Delete current segmentation" (the selector moves to a neighbour by itself, as Slicer's does),
choose another segment in the Segment selector, drag a box, Re-propagate, Undo, Redo.

The invariants, after every step: the evidence shown (key slice, reasoning, boxes) is that of the
selected segment of the segmentation the Output selector shows, made by a result in that
segmentation, or none is shown; Re-propagate is enabled only then, and a change that took the
evidence away says why in the status line; Re-propagate changes the sent segment and no other.
``MEDVOL_STATEFUL_EXAMPLES`` runs more (docs/slicer.md, "What is tested")."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("PyQt5.QtWidgets", reason="PyQt5 is not installed (bootstrap.py --no-pyqt)")
pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test  # noqa: E402
from steps import click, idle, load_ct, use_remote_worker, wait_until  # noqa: E402

EXAMPLES = int(os.environ.get("MEDVOL_STATEFUL_EXAMPLES", "6"))
STEPS = int(os.environ.get("MEDVOL_STATEFUL_STEPS", "10"))
SHRINK = os.environ.get("MEDVOL_STATEFUL_SHRINK", "1") != "0"
RUNS = []


def make_machine(panel):
    slicer, ui, logic = panel.slicer, panel.ui, panel.logic

    def segmentations():
        return list(slicer.util.getNodesByClass("vtkMRMLSegmentationNode"))

    def masks(volume):
        found = {}
        for seg in segmentations():
            s = seg.GetSegmentation()
            for i in range(s.GetNumberOfSegments()):
                sid = s.GetNthSegmentID(i)
                found[(seg.GetID(), sid)] = slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume).astype(bool)
        return found

    def changed(before, after):
        return {k for k in set(before) | set(after)
                if (k in before) != (k in after) or (k in before and not np.array_equal(before[k], after[k]))}

    class PanelWorkingSegment(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            RUNS.append(1)
            slicer.mrmlScene.Clear(0)
            self.volume = load_ct(panel)
            self.made = set()  # (segmentation ID, segment ID) a result wrote, in that segmentation
            self.cleared = False  # the last step took the evidence away

        @property
        def p(self):
            return logic.getParameterNode()

        def _shown(self):
            return bool(self.p.anchorJson)

        def _wait(self):
            wait_until(lambda: idle(panel), what="the request to end")

        @rule(query=st.sampled_from(["the organ", "the other organ"]), esc=st.booleans())
        def segment(self, query, esc):
            p = self.p
            p.inputVolume = self.volume
            ui.queryEdit.setPlainText(query)
            clash = bool(logic.existingSegmentId(p))
            if clash:
                panel.dialogs.plan("Esc" if esc else "Keep both")
            before = masks(self.volume)
            click(ui.segmentButton)
            self._wait()
            diff = changed(before, masks(self.volume))
            if clash and esc:
                assert diff == set()
                return
            assert ui.statusLabel.text.startswith("Done."), ui.statusLabel.text
            (key,) = diff
            self.made.add(key)

        @rule(which=st.integers(-1, 4))
        def choose_output(self, which):
            segs = segmentations()
            was = self._shown()
            ui.outputSegmentationSelector.setCurrentNode(None if which < 0 or not segs else segs[which % len(segs)])
            self.cleared = was and not self._shown()

        @rule()
        def create_output(self):
            was = self._shown()
            ui.outputSegmentationSelector.addNode()  # "Create new segmentation"
            self.cleared = was and not self._shown()

        @rule()
        def delete_output(self):
            if ui.outputSegmentationSelector.currentNode() is None:
                return
            was = self._shown()
            ui.outputSegmentationSelector.removeCurrentNode()  # "Delete current segmentation"
            self.cleared = was and not self._shown()

        @rule(which=st.integers(0, 5))
        def choose_segment(self, which):
            combo = ui.segmentComboBox
            if not combo.enabled or combo.count == 0:
                return
            index = which % combo.count
            combo.setCurrentIndex(index)
            combo.activated.emit(index)  # what a pick in the list sends

        @rule(dx=st.integers(-4, 4))
        def drag_box(self, dx):
            p = self.p
            boxes = [b for b in p.boxes if b is not None]
            if not boxes or not ui.addBoxButton.enabled:
                return
            c = [0.0, 0.0, 0.0]
            boxes[0].GetCenter(c)
            boxes[0].SetCenter(c[0] + dx, c[1] + 1.0, c[2])

        @rule()
        def repropagate(self):
            if not ui.repropagateButton.enabled:
                return
            p = self.p
            sent = (p.outputSegmentation.GetID(), p.segmentId)
            before = masks(self.volume)
            click(ui.repropagateButton)
            self._wait()
            assert changed(before, masks(self.volume)) <= {sent}

        @rule(undo=st.booleans())
        def undo_or_redo(self, undo):
            button = ui.undoButton if undo else ui.redoButton
            if button.enabled:
                click(button)
                p = self.p
                if p.segmentId and p.outputSegmentation is not None:
                    self.made.add((p.outputSegmentation.GetID(), p.segmentId))  # Redo puts a result back

        @invariant()
        def the_evidence_shown_is_the_selected_segments(self):
            p = self.p
            seg = ui.outputSegmentationSelector.currentNode()
            assert seg is p.outputSegmentation, "the Output selector and the parameter node disagree"
            if self._shown():
                assert seg is not None and seg.GetSegmentation().GetSegment(p.segmentId) is not None, \
                    f"evidence shown for {p.segmentId!r}, not a segment of {seg.GetName() if seg else None}"
                assert (seg.GetID(), p.segmentId) in self.made, "evidence shown for a segment no result made here"
            else:
                assert not ui.repropagateButton.enabled and ui.reasoningEdit.toPlainText() == ""
            if ui.repropagateButton.enabled:
                assert self._shown()
            if self.cleared:
                assert "Re-propagate is off" in ui.statusLabel.text, ui.statusLabel.text
                self.cleared = False

    phases = list(Phase) if SHRINK else [Phase.explicit, Phase.reuse, Phase.generate]
    PanelWorkingSegment.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=True, database=None,
        phases=phases, suppress_health_check=list(HealthCheck), print_blob=False)
    return PanelWorkingSegment


def test_generated_user_actions_in_the_panel_keep_one_answer_to_which_segment_is_worked_on(panel):
    use_remote_worker(panel)
    machine = make_machine(panel)
    RUNS.clear()
    try:
        run_state_machine_as_test(machine, settings=machine.TestCase.settings)
    finally:
        print(f"\n{len(RUNS)} generated sequences of at most {STEPS} steps")

"""The panel's segment selector: which segment's evidence the panel shows (its key slice, boxes,
corrections, range, reasoning and confidence) and which segment Re-propagate, Add box here and
points act on. It follows the Segment Editor's selection too: selecting a segment there that has
a result's evidence (or any segment of the segmentation shown) selects it here. A mixin of
:class:`.panel.MedVolR1SlicerWidget`: it shares the widget's ``ui``, parameter node, logic and
VTK observers; the scene is changed only through the logic."""

from __future__ import annotations

import slicer
import vtk

from MedVolR1SlicerLib.guibinding import show_choices
from MedVolR1SlicerLib.session import IDLE

EDITOR_TAG = "SegmentEditor"  # the Segment Editor module's parameter node (a singleton)
SEGMENT_EVENTS = ("SegmentAdded", "SegmentRemoved", "SegmentModified")


class SegmentSelection:
    """Needs from the widget: ``ui``, ``logic``, ``_parameterNode``, ``addObserver`` /
    ``removeObserver`` (VTKObservationMixin) and ``_updateGuiFromParameterNode``."""

    def _initSegmentSelection(self):
        self._segmentChoices = None
        self._observedEditor = None
        self._editorSelection = None
        self._segmentsObserved = None

    def _connectSegmentSelection(self):
        self.ui.segmentComboBox.connect("activated(int)", self.onSegmentChosen)

    def _setupSegmentSelection(self):
        """The non-Qt half: watch the Segment Editor's parameter node (made when that module is
        first shown, hence also the scene's NodeAddedEvent)."""
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.NodeAddedEvent, self.onNodeAdded)
        self._observeSegmentEditor(slicer.mrmlScene.GetSingletonNode(EDITOR_TAG, "vtkMRMLSegmentEditorNode"))

    def _forgetSegmentSelection(self):
        self._observedEditor = self._segmentsObserved = None
        self._segmentChoices = self._editorSelection = None

    @vtk.calldata_type(vtk.VTK_OBJECT)
    def onNodeAdded(self, caller, event, node):
        if node is not None and node.IsA("vtkMRMLSegmentEditorNode") and node.GetSingletonTag() == EDITOR_TAG:
            self._observeSegmentEditor(node)

    def _observeSegmentEditor(self, node):
        if node is None or node is self._observedEditor:
            return
        if self._observedEditor is not None:
            self.removeObserver(self._observedEditor, vtk.vtkCommand.ModifiedEvent, self._onSegmentEditorModified)
        self._observedEditor = node
        self._editorSelection = self._editorKey(node)
        self.addObserver(node, vtk.vtkCommand.ModifiedEvent, self._onSegmentEditorModified)

    @staticmethod
    def _editorKey(node):
        seg = node.GetSegmentationNode()
        return (seg.GetID() if seg is not None else "", node.GetSelectedSegmentID() or "")

    def _onSegmentEditorModified(self, caller=None, event=None):
        """The Segment Editor selected another segment: show its evidence, when it has some or
        belongs to the segmentation shown (any other change of the editor is not a selection)."""
        node = self._observedEditor
        if node is None:
            return
        key = self._editorKey(node)
        if key == self._editorSelection:
            return
        self._editorSelection = key
        p = self._parameterNode
        seg, segmentId = node.GetSegmentationNode(), key[1]
        if p is None or seg is None or not segmentId or self.logic.session.state != IDLE:
            return
        if p.outputSegmentation is seg and p.segmentId == segmentId:
            return
        if p.outputSegmentation is seg or self.logic.hasEvidence(p, seg, segmentId):
            self.logic.selectSegment(p, seg, segmentId)
            self._updateGuiFromParameterNode()

    def _observeSegments(self, node):
        """Segments added, removed or renamed in the segmentation shown update the selector."""
        if node is self._segmentsObserved:
            return
        if self._segmentsObserved is not None:
            for name in SEGMENT_EVENTS:
                self.removeObserver(self._segmentsObserved, getattr(slicer.vtkSegmentation, name),
                                    self._onSegmentsChanged)
        self._segmentsObserved = node
        if node is not None:
            for name in SEGMENT_EVENTS:
                self.addObserver(node, getattr(slicer.vtkSegmentation, name), self._onSegmentsChanged)

    def _onSegmentsChanged(self, caller=None, event=None):
        self._updateSegmentChoices()

    def _updateSegmentChoices(self):
        """The selector lists the segments of the segmentation shown, "(no evidence)" after those
        no result made, with the selected one current."""
        p = self._parameterNode
        seg = p.outputSegmentation if p is not None else None
        self._observeSegments(seg)
        choices = []
        if seg is not None:
            segmentation = seg.GetSegmentation()
            for i in range(segmentation.GetNumberOfSegments()):
                segmentId = segmentation.GetNthSegmentID(i)
                name = segmentation.GetNthSegment(i).GetName()
                choices.append((name if self.logic.hasEvidence(p, seg, segmentId) else f"{name} (no evidence)",
                                segmentId))
        combo = self.ui.segmentComboBox
        self._segmentChoices = show_choices(
            combo, choices, self._segmentChoices,
            lambda ids: ids.index(p.segmentId) if p is not None and p.segmentId in ids else -1)
        combo.enabled = bool(choices) and self.logic.session.state == IDLE

    def onSegmentChosen(self, index):
        p = self._parameterNode
        if p is None or self._segmentChoices is None or not 0 <= index < len(self._segmentChoices):
            return
        self.logic.selectSegment(p, p.outputSegmentation, self._segmentChoices[index][1])
        self._updateGuiFromParameterNode()

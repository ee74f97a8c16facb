"""The panel's correction controls: Add box here, the Object selector, Place points and the N key
that switches their sign, the slice range, Clear corrections; and the observers that notice a
box, a correction box or a point moved, placed or deleted in the views (each enables
Re-propagate). A mixin of :class:`.panel.MedVolR1SlicerWidget`: it shares the widget's ``ui``,
parameter node, logic and VTK observers, and calls the logic for every change of the scene."""

from __future__ import annotations

import qt
import slicer
import vtk
from slicer import vtkMRMLMarkupsFiducialNode, vtkMRMLMarkupsROINode

from MedVolR1SlicerLib.geometry import GeometryError
from MedVolR1SlicerLib.guibinding import show_choices

NEGATIVE_KEY = "N"  # toggles the sign of new points while the module is shown


def _box_events():
    """A drag moves a box's centre (a point event) or its size (the node is modified)."""
    return (vtkMRMLMarkupsROINode.PointModifiedEvent, vtk.vtkCommand.ModifiedEvent)


class CorrectionControls:
    """Needs from the widget: ``ui``, ``logic``, ``_parameterNode``, ``addObserver`` /
    ``removeObserver`` (VTKObservationMixin), ``_updateGuiFromParameterNode`` and
    ``_updateButtons``."""

    def _initCorrectionControls(self):
        self._observedBoxes = []
        self._observedPoints = None
        self._objectChoices = None
        self._negativeShortcut = None

    def _connectCorrectionControls(self):
        self.ui.addBoxButton.connect("clicked(bool)", self.onAddBoxButton)
        self.ui.objectComboBox.connect("activated(int)", self.onObjectChosen)
        self.ui.placePointsButton.connect("clicked(bool)", self.onPlacePointsButton)
        self.ui.negativePointsButton.connect("toggled(bool)", self.onNegativePoints)
        self.ui.setRangeStartButton.connect("clicked(bool)", lambda: self.onSetRangeEnd("start"))
        self.ui.setRangeEndButton.connect("clicked(bool)", lambda: self.onSetRangeEnd("end"))
        self.ui.clearRangeButton.connect("clicked(bool)", self.onClearRange)
        self.ui.clearCorrectionsButton.connect("clicked(bool)", self.onClearCorrections)

    def _forgetCorrectionObservers(self):
        self._observedBoxes = []
        self._observedPoints = None

    def _installNegativeShortcut(self):
        """N toggles the sign of new points while the module is shown, wherever the focus is
        (a slice view, while placing points), as the Segment Editor installs its keys on the
        main window; a text box keeps its N (Qt gives typed letters to it first)."""
        if self._negativeShortcut is not None or getattr(slicer, "app", None) is None:
            return
        mainWindow = slicer.util.mainWindow()
        if mainWindow is None:  # no main window (e.g. --no-main-window)
            return
        self._negativeShortcut = qt.QShortcut(qt.QKeySequence(NEGATIVE_KEY), mainWindow)
        self._negativeShortcut.connect("activated()", self.onToggleNegative)

    def _removeNegativeShortcut(self):
        if self._negativeShortcut is not None:  # as the Segment Editor deletes its shortcuts on exit
            self._negativeShortcut.setEnabled(False)
            self._negativeShortcut.deleteLater()
            self._negativeShortcut = None

    def _updateObjectChoices(self):
        """The Object selector: the objects in use, the one being started, and "New object";
        rebuilt only when the list changed."""
        p = self._parameterNode
        choices = self.logic.objectChoices(p) if p is not None and p.anchorJson else [("New object", 0)]
        current = p.correctionObject if p is not None else 0
        self._objectChoices = show_choices(
            self.ui.objectComboBox, choices, self._objectChoices,
            lambda numbers: numbers.index(current) if current in numbers else len(numbers) - 1)

    def _observeBoxes(self, boxes):
        boxes = [b for b in boxes if b is not None]
        if boxes == self._observedBoxes:
            return
        for node in self._observedBoxes:
            for event in _box_events():
                self.removeObserver(node, event, self._onBoxEdited)
        self._observedBoxes = boxes
        for node in boxes:  # a drag moves the centre (point) or the size (node modified)
            for event in _box_events():
                self.addObserver(node, event, self._onBoxEdited)

    def _onBoxEdited(self, caller=None, event=None):
        if self._parameterNode is not None and not self._parameterNode.boxesEdited:
            self._parameterNode.boxesEdited = True
        self._updateButtons()

    def _observePoints(self, node):
        """A point placed, moved or deleted in "MedVol points" enables Re-propagate."""
        if node is self._observedPoints:
            return
        events = (vtkMRMLMarkupsFiducialNode.PointAddedEvent, vtkMRMLMarkupsFiducialNode.PointRemovedEvent,
                  vtkMRMLMarkupsFiducialNode.PointModifiedEvent)
        if self._observedPoints is not None:
            for event in events:
                self.removeObserver(self._observedPoints, event, self._onPointsEdited)
        self._observedPoints = node
        if node is not None:
            for event in events:
                self.addObserver(node, event, self._onPointsEdited)

    def _onPointsEdited(self, caller=None, event=None):
        self._onBoxEdited()
        self._updateObjectChoices()  # a point of a new object makes it an object in use

    def _onInteractionModeChanged(self, caller=None, event=None):
        self._updateButtons()

    @vtk.calldata_type(vtk.VTK_OBJECT)
    def onNodeRemoved(self, caller, event, node):
        """A box, correction box or the points node deleted by the user: drop it from its field
        (during this event Slicer's parameter node wrapper may still list it, and afterwards lists
        ``None`` in its place)."""
        p = self._parameterNode
        if p is None:
            return
        if isinstance(node, vtkMRMLMarkupsFiducialNode):
            if node is self._observedPoints:
                self._observePoints(None)
            if p.points is node:
                p.points = None
                p.boxesEdited = True
            self._updateGuiFromParameterNode()
            return
        if not isinstance(node, vtkMRMLMarkupsROINode):
            return
        for name in ("boxes", "corrections"):
            nodes = getattr(p, name)
            kept = [b for b in nodes if b is not None and b is not node]
            if len(kept) != len(nodes):
                if node in self._observedBoxes:
                    self._observedBoxes.remove(node)
                    for ev in _box_events():
                        self.removeObserver(node, ev, self._onBoxEdited)
                setattr(p, name, kept)
                p.boxesEdited = True
                self._updateObjectChoices()
                self._updateButtons()

    def onAddBoxButton(self):
        """Add box here: a box on the slice the Red view shows, for the chosen object."""
        try:
            self.logic.addBoxHere(self._parameterNode)
        except GeometryError as e:
            slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
        self._updateGuiFromParameterNode()

    def onObjectChosen(self, index):
        if self._parameterNode is None or self._objectChoices is None or not 0 <= index < len(self._objectChoices):
            return
        try:
            self.logic.chooseObject(self._parameterNode, self._objectChoices[index][1])
        except GeometryError as e:
            slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
        self._updateGuiFromParameterNode()

    def onPlacePointsButton(self, on=True):
        """Place points (toggles place mode; a right-click or the toolbar ends it too)."""
        p = self._parameterNode
        if self.logic.placingPoints(p):
            self.logic.stopPlacingPoints()
        else:
            try:
                self.logic.startPlacingPoints(p)
            except GeometryError as e:
                slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
        self._updateGuiFromParameterNode()

    def onNegativePoints(self, negative):
        if self._parameterNode is not None:
            self.logic.setNegativePoints(self._parameterNode, negative)

    def onToggleNegative(self):
        """The N key: new points switch between inside (+) and outside (-)."""
        p = self._parameterNode
        if p is not None and self.ui.negativePointsButton.enabled:
            self.logic.setNegativePoints(p, not p.negativePoints)
            self.ui.statusLabel.text = "New points: " + ("outside (-)" if p.negativePoints else "inside (+)")

    def onSetRangeEnd(self, which):
        try:
            self.logic.setRangeEnd(self._parameterNode, which)
        except (GeometryError, ValueError) as e:
            slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
        self._updateGuiFromParameterNode()

    def onClearRange(self):
        self.logic.clearRange(self._parameterNode)
        self._updateGuiFromParameterNode()

    def onClearCorrections(self):
        self.logic.clearCorrections(self._parameterNode)
        self._updateGuiFromParameterNode()


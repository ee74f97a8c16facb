"""``MedVolR1SlicerLogic``: the one facade of the module's logic (the panel, the Python console,
the headless batch and the self-test use it). Nodes and plain values in, MRML out; no Qt.

It owns what lives across requests — the worker session, the temporary folder, the scene count
that keeps one scene's result out of the next, and the Undo/Redo history — and composes the parts,
which take nodes and plain values and never the logic: :mod:`.results` (a result into the scene),
:mod:`.evidence` (each segment's own evidence), :mod:`.history` (Undo and Redo, per segmentation),
:mod:`.markups` (boxes, corrections, the range, the anchor rebuilt from them), :mod:`.views`
(key slice, 3D, Segment Editor, subject hierarchy), :mod:`.storage` (files through storage
nodes), :mod:`.nodes` (which volume, which segmentation). The logic reaches Slicer only through
MRML and ``slicer.util``, so ``Testing/slicer_mrml`` runs it on ``slicer-core``."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import List, Optional, Tuple

import slicer
import vtk
from slicer.ScriptedLoadableModule import ScriptedLoadableModuleLogic

from MedVolR1SlicerLib import install
from MedVolR1SlicerLib.client import WorkerError, python_for_worker
from MedVolR1SlicerLib.geometry import GeometryError
from MedVolR1SlicerLib.session import Options, Session, query_lines

from . import evidence, markups, nodes, painted, storage, views
from .history import EditedSinceResult, History
from .parameters import MedVolR1SlicerParameterNode, drop_worker_settings
from .results import Target, apply_result

__all__ = ["MedVolR1SlicerLogic", "EditedSinceResult"]


class MedVolR1SlicerLogic(ScriptedLoadableModuleLogic):
    """Nodes and plain values in, MRML out; no GUI. Usable from Slicer's Python console::

        logic = slicer.util.getModuleLogic("MedVolR1Slicer")
        seg, segment_id, rois, anchor = logic.segmentBlocking(volumeNode, "the organ that secretes bile")

    ``session``: the :class:`Session` that talks to the worker. Slicer builds the logic with no
    argument, which gives :meth:`defaultSession`; a test or a script may pass its own (another
    worker command, a recording client).
    """

    # > 0 while a logic is changing the selection in several writes (followed once it is done);
    # shared, because every logic of the module (the panel's, the self-test's, a script's) watches
    # the same parameter node
    _quiet = 0

    def __init__(self, session: Optional[Session] = None):
        ScriptedLoadableModuleLogic.__init__(self)
        self.session = session if session is not None else self.defaultSession()
        self._files = storage.ExportFolder()
        self._history = History()  # Undo and Redo, per segmentation
        self._generation = 0  # scenes closed so far: a result started in an earlier one is dropped
        self._ignoredWorkerSettings = {}  # what a scene of an older version said about the worker
        # called with a segmentation node just before a result or Undo changes it (the panel saves
        # the Segment Editor's undo state there, so Ctrl+Z in the editor takes a result back too)
        self.beforeChange = None
        # called with the line that says why the evidence shown changed or went (the panel's status)
        self.selectionChanged = None
        self._watched = []  # [(node, tag)]: the parameter node and the Output segmentation's segments
        scene = slicer.mrmlScene
        self._sceneObservers = [(scene, scene.AddObserver(scene.StartCloseEvent, self._onSceneStartClose))]
        for event in (scene.EndCloseEvent, scene.EndImportEvent):
            self._sceneObservers.append((scene, scene.AddObserver(event, self._onSceneChanged)))
        self._sceneObservers.append((scene, scene.AddObserver(scene.NodeRemovedEvent, self._onNodeRemoved)))
        # the evidence the panel shows goes back to its segment's evidence node before the scene
        # is saved (it is then in the file) or another scene is imported (which replaces the
        # module's parameter node with its own)
        for event in (scene.StartSaveEvent, scene.StartImportEvent):
            self._sceneObservers.append((scene, scene.AddObserver(event, self._onStoreEvidence)))

    @staticmethod
    def defaultSession() -> Session:
        """A local worker run by Slicer's Python (``PythonSlicer``) in Slicer's start-up environment."""
        env = None
        try:
            env = slicer.util.startupEnvironment()  # the child Python gets Slicer's clean environment
        except AttributeError:
            pass
        return Session(python=python_for_worker(), env=env)

    def getParameterNode(self):
        """The module's parameter node (wrapped). Worker settings that a scene saved by an older
        version carries are removed from it first, never used (:meth:`takeIgnoredWorkerSettings`)."""
        node = super().getParameterNode()
        self._ignoredWorkerSettings.update(drop_worker_settings(node))
        p = MedVolR1SlicerParameterNode(node)
        self._watch(p)
        return p

    def takeIgnoredWorkerSettings(self) -> dict:
        """The worker settings (``{"worker": …, "remoteUrl": …}``) that a scene of an older version
        carried and that were removed unread since the last call; ``{}`` when none. The worker is
        the application's setting: a scene never chooses where a CT is sent."""
        self._ignoredWorkerSettings.update(drop_worker_settings(super().getParameterNode()))
        found, self._ignoredWorkerSettings = self._ignoredWorkerSettings, {}
        return found

    # the worker and the scene's lifetime

    def tempDir(self) -> str:
        """The module's temporary folder: exported volumes, the pip constraints file. Removed by
        :meth:`cleanup` (module cleanup) and, failing that, when Python exits."""
        return self._files.path()

    def poll(self):
        self.session.poll(0.0)

    def cancel(self):
        self.session.cancel()

    def shutdown(self):
        """Stop the worker (the next request starts a new one); the temporary files stay."""
        self.session.shutdown()

    def _onSceneStartClose(self, caller=None, event=None):
        """The scene is closing (the next patient is coming): cancel the request that runs, and
        make sure nothing of this scene (a result, an exported volume, an Undo) reaches the next."""
        self._generation += 1
        if self.session.job is not None:
            try:
                self.session.cancel()
            except Exception:  # noqa: BLE001 - a dead worker: its job fails on its own
                logging.exception("MedVol-R1: cancelling on scene close failed")
        self._history.clear()
        self._files.forget_exports()

    def _onStoreEvidence(self, caller=None, event=None):
        evidence.store(self._shown())

    def _onSceneChanged(self, caller=None, event=None):
        """A scene closed or imported: the parameter node may be another one, or lost its nodes."""
        self.followSelection(announce=event != "EndCloseEvent")

    def _onNodeRemoved(self, caller=None, event=None):
        scene = slicer.mrmlScene
        if not (scene.IsClosing() or scene.IsImporting()):
            evidence.prune()  # the evidence of a segmentation that is gone goes with it

    # which segment is worked on: one answer (evidence.follow_selection)

    def _watch(self, p) -> None:
        """Follow the selection whenever the parameter node changes or a segment of the Output
        segmentation is removed, whoever did it (the panel, Qt's selector, a script)."""
        wanted = [p.parameterNode, p.outputSegmentation]
        if [n for n, _ in self._watched] == [n for n in wanted if n is not None]:
            return
        for node, tag in self._watched:
            node.RemoveObserver(tag)
        self._watched = [(p.parameterNode, p.parameterNode.AddObserver(vtk.vtkCommand.ModifiedEvent,
                                                                       self._onSelectionMaybeChanged))]
        if p.outputSegmentation is not None:
            seg = p.outputSegmentation
            self._watched.append((seg, seg.AddObserver(slicer.vtkSegmentation.SegmentRemoved,
                                                       self._onSelectionMaybeChanged)))

    def _onSelectionMaybeChanged(self, caller=None, event=None):
        self.followSelection()

    def followSelection(self, p=None, announce: bool = True) -> str:
        """Make the evidence shown that of the selected segment of the Output segmentation again,
        or show none (:func:`.evidence.follow_selection`); returns the line that says why ('' when
        nothing changed), also given to :attr:`selectionChanged`. The logic calls it whenever the
        parameter node changes or a segment of the Output segmentation is removed."""
        scene = slicer.mrmlScene
        if MedVolR1SlicerLogic._quiet or scene.IsClosing() or scene.IsImporting():
            return ""
        p = p if p is not None else self._shown()
        MedVolR1SlicerLogic._quiet += 1
        try:
            note = evidence.follow_selection(p)
        finally:
            MedVolR1SlicerLogic._quiet -= 1
        self._watch(p)
        if note and announce and self.selectionChanged is not None:
            self.selectionChanged(note)
        return note

    @contextlib.contextmanager
    def _changingSelection(self, p):
        """The logic changes the selection in several writes: follow it once, when done."""
        MedVolR1SlicerLogic._quiet += 1
        try:
            yield
        finally:
            MedVolR1SlicerLogic._quiet -= 1
        self.followSelection(p)

    def cleanup(self):
        """Stop the worker, stop watching the scene and remove the temporary folder (the module
        is unloaded or Slicer exits)."""
        for node, tag in self._sceneObservers + self._watched:
            node.RemoveObserver(tag)
        self._sceneObservers, self._watched = [], []
        self.shutdown()
        self._files.remove()

    def runInstallPlan(self, plan, progress=None):
        """Run an :class:`install.InstallPlan` with this Slicer's pip helper (``slicer.packaging``
        on 5.12, ``slicer.util.pip_install`` on 5.10) and the PyTorch extension; raises
        :class:`install.InstallError` (one line) on the first failure."""
        install.run_plan(plan, os.path.join(self.tempDir(), "constraints.txt"), slicer.util,
                         packaging=install.slicer_packaging(), progress=progress)

    # files and nodes (storage.py, nodes.py)

    geometry = staticmethod(nodes.geometry)
    _storageError = staticmethod(storage.storage_error)
    writeVolumeFile = staticmethod(storage.write_volume_file)
    writeSegmentationFile = staticmethod(storage.write_segmentation_file)
    readLabelmapFile = staticmethod(storage.read_labelmap_file)
    volumeProblem = staticmethod(nodes.volume_problem)
    referenceVolume = staticmethod(nodes.reference_volume)
    existingSegmentId = staticmethod(nodes.existing_segment_id)
    _inScene = staticmethod(nodes.in_scene)

    firstUsableVolume = staticmethod(nodes.first_usable_volume)

    def readMask(self, path: str, volumeNode, atLeast: int = 1):
        """The worker's mask on ``volumeNode``'s grid (:func:`.storage.read_mask`)."""
        return storage.read_mask(path, volumeNode, atLeast)

    def exportVolume(self, volumeNode) -> str:
        """The volume as the uncompressed NIfTI the worker reads (:meth:`.storage.ExportFolder.export`)."""
        return self._files.export(volumeNode)

    def resultProblem(self, p) -> str:
        """Why the boxes in ``p`` cannot be edited or re-propagated (:func:`.nodes.result_problem`)."""
        return nodes.result_problem(p)

    def repropagateProblem(self, p) -> str:
        """Why Re-propagate cannot run now ('' when it can): no segment with a result's evidence
        is selected, or what :meth:`resultProblem` says."""
        if not p.anchorJson or evidence.segment_of(p.evidenceSegmentation, p.segmentId) is None:
            return ("segment first: no segment with a result's evidence is selected (click Segment, or select a "
                    "segment a result made); nothing was re-propagated")
        return nodes.result_problem(p)

    def _live(self, nodeList) -> list:
        return nodes.live(nodeList)

    # requests

    def _target(self, p, volume, replaceSegmentId: str = "", repropagate: bool = False) -> Target:
        """Where the result of a request started now goes, fixed now: edits of the panel while
        the worker runs (query, output, Replace/Keep both) do not move it. Re-propagate's goes
        into the segment whose evidence it sends, in the segmentation that holds it, or nowhere."""
        notes = []
        segmentation = p.evidenceSegmentation if repropagate else p.outputSegmentation
        if segmentation is not None:
            ref = nodes.reference_volume(segmentation)
            if ref is not None and ref is not volume and nodes.in_scene(ref):
                if repropagate:
                    raise ValueError(f"{segmentation.GetName()} belongs to {ref.GetName()}, not to "
                                     f"{volume.GetName()}; nothing was re-propagated")
                notes.append(f"{segmentation.GetName()} belongs to {ref.GetName()}; the result went into a new "
                             "segmentation")
                segmentation, replaceSegmentId = None, ""
        try:
            queries = query_lines(p.query)
        except WorkerError:  # no query: a re-propagation needs none, a Segment is refused on sending
            queries = []
        keep = evidence.segment_of(segmentation, replaceSegmentId) if repropagate else None
        return Target(volume, segmentation, replaceSegmentId, p.query, self._generation, notes,
                      queries if len(queries) > 1 else None, keepSegment=keep.GetName() if keep is not None else "")

    def startSegment(self, p, options: Options, onFinished=None, replaceExisting: bool = False):
        volume = p.inputVolume
        problem = nodes.volume_problem(volume)
        if problem:
            raise ValueError(problem)
        self.geometry(volume)  # refuse transformed volumes before the long run
        target = self._target(p, volume, nodes.existing_segment_id(p) if replaceExisting else "")
        # a local worker writes the consensus's agreement map where we say; a remote one only into
        # its own output folder, so over HTTP the panel shows the confidence alone
        agreement = ""
        if options.consensus > 1 and options.worker == "local":
            agreement = os.path.join(self.tempDir(), f"agreement-{uuid.uuid4().hex[:12]}.nii.gz")
        job = self.session.segment(self.exportVolume(volume), p.query, options, agreement=agreement)
        job.finished.connect(lambda j: self._finish(p, target, j, [], onFinished))
        return job

    def startRepropagate(self, p, options: Options, onFinished=None) -> Tuple[object, List[str]]:
        """Re-run MedSAM2 on the edited boxes and the corrections (:meth:`anchorFromBoxes`:
        ``medvol.anchor/2`` only when there are prompts or a slice range; ``/4`` with the slices
        of the segment painted since the result, :mod:`.painted`). Returns ``(job,
        notes)``: notes say which boxes had to be put back on their slice or cut to the image.
        The result replaces the segment whose evidence is sent, in its segmentation, and nothing
        else; raises ``ValueError`` (one line, nothing sent) when no segment's evidence is selected."""
        self.followSelection(p)
        problem = self.repropagateProblem(p)
        if problem:
            raise ValueError(problem)
        anchor, notes = self.anchorFromBoxes(p)
        anchor = painted.add_mask_prompts(p, anchor)  # slices repainted since the result (medvol.anchor/4)
        volume = p.resultVolume
        target = self._target(p, volume, p.segmentId, repropagate=True)
        job = self.session.propagate(self.exportVolume(volume), anchor, options)
        job.finished.connect(lambda j: self._finish(p, target, j, notes, onFinished))
        return job, notes

    @staticmethod
    def _failJob(job, error: Exception) -> None:
        """A result that came back but could not be put in the scene fails its job, so that the
        panel shows it and ``segmentBlocking`` raises it (instead of returning stale values)."""
        logging.exception("MedVol-R1: applying the result failed")
        kind = "" if isinstance(error, (GeometryError, ValueError, OSError)) else f"{type(error).__name__}: "
        job.state = "failed"
        job.error = WorkerError("apply_failed", f"the result could not be put in the scene: {kind}{error}")

    def _targetGone(self, target: Target) -> str:
        if target.generation != self._generation:
            return "the scene was closed while the worker ran; nothing was added to the new scene"
        if not nodes.in_scene(target.volume):
            return "the volume was removed while the worker ran; nothing was added"
        if target.segmentation is not None and not nodes.in_scene(target.segmentation):
            return "the output segmentation was removed while the worker ran; nothing was added"
        if target.keepSegment and evidence.segment_of(target.segmentation, target.replaceSegmentId) is None:
            return (f"“{target.keepSegment}” was removed from {target.segmentation.GetName()} while the worker "
                    "ran; nothing was written")
        return ""

    def _finish(self, p, target: Target, job, notes, onFinished):
        notes = list(notes)
        if job.state == "done":
            gone = self._targetGone(target)
            if gone:  # never put a result into a scene or onto a volume it was not made for
                job.state = "cancelled"
                job.error = WorkerError("cancelled", gone)
            else:
                try:
                    notes = notes + target.notes + self.applyResult(p, target.volume, job.result, target=target)
                except Exception as e:  # noqa: BLE001 - every failure must reach the panel and the caller
                    self._failJob(job, e)
        if onFinished:
            onFinished(job, notes)

    # results and Undo (results.py)

    def applyResult(self, p, volumeNode, result: dict, replaceSegment: bool = False,
                    target: Optional[Target] = None) -> List[str]:
        """Put ``result`` into the scene (:func:`.results.apply_result`) and add its Undo step to
        its segmentation's history; returns notes for the user. ``target`` (from the request's
        start) names the segmentation and the segment to replace; without one they are read from
        ``p`` now (``replaceSegment``: replace ``p.segmentId``). A "not present" answer adds
        nothing and keeps the last result (and its Undo) as it was."""
        if target is None:
            target = Target(volumeNode, p.outputSegmentation, p.segmentId if replaceSegment else "", p.query,
                            self._generation, [])
        with self._changingSelection(p):
            notes, step = apply_result(p, volumeNode, result, target, beforeChange=self.beforeChange)
        if step is not None:
            self._history.push(step)
            for change in step.changes:  # what a slice painted later is compared with (Redo puts it back)
                if change.after.present and painted.remember_result(p, step.segmentation, change.segmentId,
                                                                    step.volume):
                    change.after.resultSlices = painted.result_digests(step.segmentation, change.segmentId)
        return notes

    def segmentPainted(self, p) -> bool:
        """Whether the result's segment was repainted on a slice since the result (:mod:`.painted`)."""
        return painted.segment_painted(p)

    # Undo and Redo (history.py): of the segmentation the panel shows, never another's

    def _shown(self):
        """The parameter node as it is (what the panel shows; nothing dropped from it here)."""
        return MedVolR1SlicerParameterNode(ScriptedLoadableModuleLogic.getParameterNode(self))

    def _step(self, p, undo: bool):
        return self._history.top(p.outputSegmentation, undo) if p is not None else None

    def undoDepth(self, p=None, undo: bool = True) -> int:
        """How many results of the shown segmentation Undo (``undo``) or Redo can take back."""
        p = p if p is not None else self._shown()
        return self._history.depth(p.outputSegmentation, undo) if self._step(p, undo) is not None else 0

    @property
    def canUndo(self) -> bool:
        return self._step(self._shown(), True) is not None

    @property
    def canRedo(self) -> bool:
        return self._step(self._shown(), False) is not None

    def editedSinceResult(self, undo: bool = True) -> int:
        """How many voxels of the segments the last result (``undo``) or the last Undo (Redo) wrote
        were changed since (Segment Editor, another module, a script): what Undo or Redo would
        throw away. 0 when none or nothing to undo."""
        step = self._step(self._shown(), undo)
        return step.edited_voxels(undo)[0] if step is not None else 0

    def _undoOrRedo(self, undo: bool, discardEdits: bool, p=None) -> bool:
        p = p if p is not None else self._shown()
        step = self._step(p, undo)
        if step is None:
            return False
        with self._changingSelection(p):
            step.apply(p, undo, discardEdits, self.beforeChange)  # raises before changing anything
        self._history.move(step.segmentation, undo)
        return True

    def undoLastResult(self, discardEdits: bool = False, p=None) -> bool:
        """Take back the last result of the shown segmentation: its segments and their evidence
        as they were before it. Raises :class:`EditedSinceResult` when a segment was edited after
        the result, unless ``discardEdits``: Undo would silently throw those edits away."""
        return self._undoOrRedo(True, discardEdits, p)

    def redoLastResult(self, discardEdits: bool = False, p=None) -> bool:
        """Put back the result Undo took back last (segments and evidence), as :meth:`undoLastResult`."""
        return self._undoOrRedo(False, discardEdits, p)

    def undoText(self, p=None, undo: bool = True) -> str:
        """What Undo (or Redo) would take back, e.g. "the liver, the spleen" ('' when nothing)."""
        step = self._step(p if p is not None else self._shown(), undo)
        return step.label if step is not None else ""

    # each segment's evidence (evidence.py)

    def selectSegment(self, p, segmentationNode, segmentId: str) -> bool:
        """Show the evidence of segment ``segmentId`` of ``segmentationNode`` (the panel's
        segment list, the Segment Editor's selection); Re-propagate, Add box here and points act
        on it from now on. Returns whether it has a result's evidence."""
        with self._changingSelection(p):
            evidence.select_segment(p, segmentationNode, segmentId)
        return bool(p.anchorJson)

    def hasEvidence(self, p, segmentationNode, segmentId: str) -> bool:
        return evidence.has_evidence(p, segmentationNode, segmentId)

    def storeEvidence(self, p) -> None:
        """Write what ``p`` shows back to its segment's evidence node (done on save and import)."""
        evidence.store(p)

    # the views around the result (views.py)

    placeInStudy = staticmethod(views.place_in_study)
    showKeySlice = staticmethod(views.show_key_slice)
    redSliceNode = staticmethod(views.red_slice_node)
    _interactionNode = staticmethod(views.interaction_node)

    def setShow3D(self, p, show: bool) -> bool:
        return views.set_show_3d(p, show)

    def showsSurface(self, p) -> bool:
        """Whether the result's segmentation has a closed-surface representation (what Show 3D shows)."""
        return views.shows_surface(p)

    def segmentEditorNode(self, p):
        return views.segment_editor_node(p)

    def keySliceText(self, p) -> str:
        return views.key_slice_text(p)

    def jumpToKeySlice(self, p) -> bool:
        return views.jump_to_key_slice(p)

    def redSliceCentre(self) -> List[float]:
        """RAS of the centre of what the Red slice view shows."""
        return views.red_slice_centre(self.redSliceNode())

    # boxes, corrections and the range (markups.py)

    nodeObject = staticmethod(markups.node_object)
    nodeSlice = staticmethod(markups.node_slice)
    _getRoi = staticmethod(markups.get_roi)
    _setRoi = staticmethod(markups.set_roi)

    def placeBoxes(self, p, volumeNode, anchor: dict):
        return markups.place_boxes(p, volumeNode, anchor)

    def anchorFromBoxes(self, p):
        return markups.anchor_from_boxes(p)

    def addBox(self, p):
        return markups.add_box(p)

    def addBoxHere(self, p, objectNumber: Optional[int] = None, ras=None, sliceIndex: Optional[int] = None):
        """A box on the slice the Red view shows (or through ``ras``, or slice ``sliceIndex``):
        :func:`.markups.add_box_here`."""
        return markups.add_box_here(p, objectNumber, ras, sliceIndex, here=self.redSliceCentre)

    def objectNumbers(self, p) -> List[int]:
        return markups.object_numbers(p)

    def nextObjectNumber(self, p) -> int:
        return markups.next_object_number(p)

    def objectChoices(self, p) -> List[Tuple[str, int]]:
        return markups.object_choices(p)

    def chooseObject(self, p, number: int) -> int:
        return markups.choose_object(p, number)

    def pointsNode(self, p, create: bool = True):
        return markups.points_node(p, create)

    def updatePointLabelFormat(self, p) -> str:
        return markups.update_point_label_format(p)

    def setNegativePoints(self, p, negative: bool) -> None:
        markups.set_negative_points(p, negative)

    def addPoint(self, p, ras, positive: Optional[bool] = None, objectNumber: Optional[int] = None) -> int:
        """Add a point at ``ras`` (the console's and the tests' way; in the views, Place points)."""
        return markups.add_point(p, ras, positive, objectNumber)

    def startPlacingPoints(self, p) -> bool:
        return markups.start_placing_points(p)

    def stopPlacingPoints(self) -> None:
        markups.stop_placing_points()

    def placingPoints(self, p) -> bool:
        return markups.placing_points(p)

    def setRangeEnd(self, p, which: str, ras=None) -> int:
        """Set the range's ``"start"`` or ``"end"`` to the slice the Red view shows (or through ``ras``)."""
        return markups.set_range_end(p, which, ras, here=self.redSliceCentre)

    def clearRange(self, p) -> None:
        markups.clear_range(p)

    def sliceRange(self, p) -> Optional[Tuple[int, int]]:
        return markups.slice_range(p)

    def rangeText(self, p) -> str:
        return markups.range_label(p)

    def hasCorrections(self, p) -> bool:
        return markups.has_corrections(p)

    def clearCorrections(self, p) -> bool:
        return markups.clear_corrections(p)

    # blocking use (Python console, headless batch)

    def segmentBlocking(self, volumeNode, query, options: Optional[Options] = None, segmentationNode=None,
                        timeout: Optional[float] = None):
        """Segment and wait. Returns ``(segmentationNode, segmentId, roiNodes, anchor)``, the anchor
        being this request's own; when the model answered that the target is not in this CT
        (``anchor["absent"]``) nothing was added: ``(None, "", [], anchor)``. Raises
        :class:`WorkerError` on failure."""
        p = self.getParameterNode()
        evidence.forget_shown(p)  # what was shown stays with its own segment
        p.inputVolume = volumeNode
        p.query = query
        p.outputSegmentation = segmentationNode
        job = self.startSegment(p, options or Options(preset=p.preset, device=p.device))
        self.session.wait(job, timeout)
        if job.error is not None:
            raise job.error
        return self._blockingResult(p, job)

    def repropagateBlocking(self, options: Optional[Options] = None, timeout: Optional[float] = None):
        """Re-propagate the (edited) boxes and corrections of the selected segment (the last result's,
        unless :meth:`selectSegment` chose another) and wait; that segment is replaced. Returns what :meth:`segmentBlocking` returns; raises :class:`WorkerError`."""
        p = self.getParameterNode()
        job, _ = self.startRepropagate(p, options or Options(preset=p.preset, device=p.device))
        self.session.wait(job, timeout)
        if job.error is not None:
            raise job.error
        return self._blockingResult(p, job)

    @staticmethod
    def _blockingResult(p, job):
        """What the blocking calls return, from ``job``'s own result (never an earlier one's)."""
        anchor = (job.result or {}).get("anchor") or {}
        if anchor.get("absent"):
            return None, "", [], anchor
        return p.outputSegmentation, p.segmentId, list(p.boxes), anchor


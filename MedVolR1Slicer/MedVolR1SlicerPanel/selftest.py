"""The module's self-test, as Slicer's extension build machines run it (ctest), and the stand-in
worker it injects (as SlicerNNUnet injects its process). No Qt: it drives the logic on MRML, so
``Testing/slicer_mrml`` runs it on ``slicer-core`` too."""

import os

import slicer
import vtk
from slicer.ScriptedLoadableModule import ScriptedLoadableModuleTest

from MedVolR1SlicerLib import install
from MedVolR1SlicerLib.client import WorkerError
from MedVolR1SlicerLib.geometry import anchor_from_rois
from MedVolR1SlicerLib.session import Options
from MedVolR1SlicerScene.logic import MedVolR1SlicerLogic
from MedVolR1SlicerScene.history import EditedSinceResult


class SelfTestWorker:
    """A worker client for the self-test only (injected as SlicerNNUnet injects its process):
    it answers ``segment`` with a box around the brightest voxels' bounding box (of several
    ``queries``: for the first, the others "not present") and ``propagate``
    with the boxes it is sent, as masks on the volume's grid written through MRML. It lets the
    self-test check the module's MRML side on any Slicer, including the extension build
    machines, which have none of torch, transformers or sam2. It is never used outside the test."""

    running = True
    starts = 1

    def __init__(self, logic, volumeNode):
        from MedVolR1SlicerLib.client import Job

        self._Job, self.logic, self.volume = Job, logic, volumeNode
        self.queue, self.requests, self.stopped, self.n = [], [], False, 0

    def submit(self, op, **fields):
        self.n += 1
        job = self._Job(str(self.n), op, fields)
        self.requests.append((op, fields))
        self.queue.append(job)
        return job

    def _answer(self, job):
        import numpy as np

        if job.op == "hello":  # what it says it is (a remote worker is asked before the first upload)
            return {"protocol": 1, "medvolcore": "self-test", "transport": "self-test",
                    "model_label": "the module's self-test worker (no model)"}
        if job.op == "load":
            return {"preset": job.request["preset"]}
        geo = self.logic.geometry(self.volume)
        label = slicer.vtkMRMLLabelMapVolumeNode()
        m = vtk.vtkMatrix4x4()
        self.volume.GetIJKToRASMatrix(m)
        label.SetIJKToRASMatrix(m)
        image = vtk.vtkImageData()
        image.SetDimensions(self.volume.GetImageData().GetDimensions())
        image.AllocateScalars(vtk.VTK_UNSIGNED_CHAR, 1)
        label.SetAndObserveImageData(image)
        mask = slicer.util.arrayFromVolume(label)  # (k, j, i)
        mask[:] = 0
        if job.op == "segment":
            ijk = np.argwhere(slicer.util.arrayFromVolume(self.volume) > 100)[:, ::-1]  # (i, j, k)
            lo, hi = ijk.min(axis=0), ijk.max(axis=0)
            k = int((lo[geo.slice_axis] + hi[geo.slice_axis]) // 2)
            lo[geo.slice_axis] = hi[geo.slice_axis] = k
            rois = [geo.roi_from_voxels(list(lo), list(hi))]
        else:
            rois = [geo.roi_from_world_box(c)[0] for c in job.request["anchor"]["world"]["boxes_ras"]]
            k = geo.slice_of(rois[0].center)
        anchor, _ = anchor_from_rois(geo, rois, k, query=job.request.get("query", ""), reasoning="self-test")
        anchor.update(slice=k, source="grounder" if job.op == "segment" else "user")
        sent = job.request.get("anchor") or {}
        if sent.get("schema") == "medvol.anchor/2":  # the corrections that ran come back (world form)
            anchor["schema"] = sent["schema"]
            if sent.get("prompts"):
                anchor["prompts"] = sent["prompts"]
            if "z_range_ras" in sent["world"]:
                anchor["world"]["z_range_ras"] = sent["world"]["z_range_ras"]
        for roi in rois:  # the box on every slice: a cuboid through the volume
            c = geo.to_ijk(roi.corners())
            lo, hi = np.ceil(c.min(axis=0)).astype(int), np.floor(c.max(axis=0)).astype(int)  # voxel edges → centres
            lo, hi = np.maximum(lo, 0), np.minimum(hi, np.array(geo.shape) - 1)
            mask[:, lo[1]:hi[1] + 1, lo[0]:hi[0] + 1] = 1
        path = os.path.join(self.logic.tempDir(), f"selftest-mask-{job.id}.nii")
        self.logic.writeVolumeFile(label, path)
        queries = job.request.get("queries")
        if queries:  # several queries: the first is found (label 1), the others are answered absent
            targets = [{"label": 1, "query": queries[0], "absent": False, "anchor": dict(anchor, query=queries[0]),
                        "reasoning": "self-test"}]
            targets += [{"label": k, "query": q, "absent": True, "reasoning": "self-test",
                         "anchor": {"schema": "medvol.anchor/3", "absent": True, "query": q}}
                        for k, q in enumerate(queries[1:], start=2)]
            return {"queries": queries, "targets": targets, "mask_path": path, "absent": False, "notes": [],
                    "smoke": False}
        return {"anchor": anchor, "mask_path": path, "notes": [], "smoke": False}

    def poll(self, timeout=0.0):
        done = 0
        while self.queue:
            job = self.queue.pop(0)
            job._finish(self._answer(job))
            done += 1
        return done

    def wait(self, job, timeout=None):
        while not job.done:
            self.poll()
        return job

    def cancel(self, job):
        if job in self.queue:
            self.queue.remove(job)
            job._finish(error=WorkerError("cancelled", "cancelled"))

    def stop(self):
        self.stopped = True


class MedVolR1SlicerTest(ScriptedLoadableModuleTest):
    """The module's self-test, as Slicer's extension build machines run it (ctest).

    ``test_module_with_selftest_worker`` runs everywhere: the module's MRML side (segment, the
    boxes on the key slice, an edit in the segment then Undo, corrections sent as a
    ``medvol.anchor/2`` anchor and placed back, a scene closed while a request runs, a switched
    volume) with :class:`SelfTestWorker` injected, no heavy package and no worker
    process. ``test_segment_edit_repropagate`` runs the real worker with the ``tiny`` preset
    (random weights, no download) and is skipped, with a message, where the MedVol-R1 packages
    are not installed. (The same steps run in CI against slicer-core: Testing/slicer_mrml.)

    Slicer runs the tests two ways: the developer "Test" button calls :meth:`runTest`, and the
    extension's ctest (``slicer_add_python_unittest``) runs ``slicer.testing.runUnitTest``, which
    loads the module's ``test_*`` methods with ``unittest.TestLoader().loadTestsFromName`` and
    runs each on its own, never calling :meth:`runTest`. So a test that needs the packages skips
    itself (:meth:`_skipWithoutPackages`, unittest's ``skipTest``), whichever way it runs."""

    NEEDS_PACKAGES = "the MedVol-R1 packages are not installed here"

    def setUp(self):
        slicer.mrmlScene.Clear()

    def runTest(self):
        self.setUp()
        self.test_module_with_selftest_worker()
        self.setUp()
        if install.current_plan().needed:
            self.delayDisplay(f"Skipping the worker test: {self.NEEDS_PACKAGES}")
        else:
            self.test_segment_edit_repropagate()

    def _skipWithoutPackages(self):
        """Skip the calling test (unittest's ``skipTest``, with the reason) where the MedVol-R1
        packages are missing, as on the extension build machines."""
        plan = install.current_plan()
        if plan.needed:
            missing = ", ".join(getattr(plan, "missing", ()) or ())
            self.skipTest(f"{self.NEEDS_PACKAGES}" + (f" (missing: {missing})" if missing else "")
                          + "; click Segment in the panel once to install them")

    @staticmethod
    def _syntheticCT(name):
        import numpy as np

        node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLScalarVolumeNode", name)
        image = vtk.vtkImageData()
        image.SetDimensions(48, 40, 12)
        image.AllocateScalars(vtk.VTK_SHORT, 1)
        node.SetAndObserveImageData(image)
        node.SetSpacing(1.5, 1.5, 3.0)
        a = slicer.util.arrayFromVolume(node)
        a[:] = -1000
        a[3:9, 10:30, 12:36] = 300  # an "organ"
        slicer.util.arrayFromVolumeModified(node)
        return node

    def test_module_with_selftest_worker(self):
        from MedVolR1SlicerLib.session import Session

        volume = self._syntheticCT("PatientA_CT")
        clients = []
        logic = MedVolR1SlicerLogic(session=Session(
            client_factory=lambda options: clients.append(SelfTestWorker(logic, volume)) or clients[-1]))
        options = Options(preset="tiny", device="cpu")
        try:
            self.delayDisplay("Segmenting with the self-test worker")
            seg, segmentId, boxes, anchor = logic.segmentBlocking(volume, "the organ", options)
            self.assertEqual(seg.GetSegmentation().GetSegment(segmentId).GetName(), "the organ")
            got = slicer.util.arrayFromSegmentBinaryLabelmap(seg, segmentId, volume)
            self.assertEqual(int(got.sum()), 12 * 20 * 24)
            p = logic.getParameterNode()
            self.assertIs(p.resultVolume, volume)
            geo = logic.geometry(volume)
            for node in boxes:
                c = [0.0, 0.0, 0.0]
                node.GetCenter(c)
                self.assertEqual(geo.slice_of(c), p.keySliceIJK)

            self.delayDisplay("An edit after the result, then Undo")
            got = got.copy()
            got[0, 0, 0] = 1
            slicer.util.updateSegmentBinaryLabelmapFromArray(got, seg, segmentId, volume)
            self.assertEqual(logic.editedSinceResult(), 1)
            with self.assertRaises(EditedSinceResult):
                logic.undoLastResult()
            self.assertIsNotNone(seg.GetSegmentation().GetSegment(segmentId))  # nothing was undone
            self.assertTrue(logic.undoLastResult(discardEdits=True))
            self.assertIsNone(seg.GetSegmentation().GetSegment(segmentId))

            self.delayDisplay("Corrections: a box on another slice, a negative point, a slice range")
            seg, segmentId, boxes, anchor = logic.segmentBlocking(volume, "the organ", options)
            k = p.keySliceIJK
            logic.chooseObject(p, 1)
            logic.addBoxHere(p, ras=geo.slice_center_ras(k + 2))
            logic.addPoint(p, geo.slice_center_ras(k - 1), positive=False, objectNumber=1)
            logic.setRangeEnd(p, "start", ras=geo.slice_center_ras(k - 2))
            logic.setRangeEnd(p, "end", ras=geo.slice_center_ras(k + 3))
            logic.repropagateBlocking(options)
            sent = clients[-1].requests[-1][1]["anchor"]
            self.assertEqual(sent["schema"], "medvol.anchor/2")
            self.assertEqual([(q["object"], q["world"]["box_ras"] is None) for q in sent["prompts"]],
                             [(1, False), (1, True)])
            self.assertEqual(len(p.corrections), 1)  # what ran is shown again
            self.assertEqual(p.points.GetNthControlPointLabel(0), "-1")
            self.assertEqual(logic.sliceRange(p), (k - 2, k + 3))

            self.delayDisplay("The input volume switched: the boxes stay with their volume")
            seg, segmentId, boxes, anchor = logic.segmentBlocking(volume, "the organ", options)
            other = self._syntheticCT("PatientA_CT_2")
            p.inputVolume = other
            with self.assertRaises(ValueError):
                logic.startRepropagate(p, options)

            self.delayDisplay("The scene closed while a request runs")
            p.inputVolume = volume
            job = logic.startSegment(p, options)
            slicer.mrmlScene.Clear(0)
            newcomer = self._syntheticCT("PatientB_CT")
            logic.session.wait(job)
            self.assertEqual(job.state, "cancelled")
            self.assertEqual(slicer.mrmlScene.GetNodesByClass("vtkMRMLSegmentationNode").GetNumberOfItems(), 0)
            self.assertEqual(slicer.mrmlScene.GetNodesByClass("vtkMRMLMarkupsROINode").GetNumberOfItems(), 0)
            self.assertEqual(slicer.mrmlScene.GetNodesByClass("vtkMRMLMarkupsFiducialNode").GetNumberOfItems(), 0)
            p = logic.getParameterNode()
            self.assertEqual((p.anchorJson, p.segmentId, p.resultVolume), ("", "", None))  # nothing of A
            self.assertFalse(logic.canUndo)
            self.assertEqual(logic.firstUsableVolume(), newcomer)
        finally:
            logic.cleanup()
        self.delayDisplay("MedVol-R1 self-test (MRML side) passed")

    def test_segment_edit_repropagate(self):
        import numpy as np

        self._skipWithoutPackages()
        from medvolcore.resources import resource_path  # the sample CT travels with medvolcore

        self.delayDisplay("Loading the sample CT")
        volume = slicer.util.loadVolume(str(resource_path("samples/abdomen_ct_30slices.nii.gz")))
        logic = MedVolR1SlicerLogic()
        options = Options(preset="tiny", device="cpu")
        try:
            self.delayDisplay("Segmenting with the tiny preset")
            seg, segmentId, boxes, anchor = logic.segmentBlocking(volume, "the organ that secretes bile", options,
                                                                 timeout=600)
            self.assertIsNotNone(seg.GetSegmentation().GetSegment(segmentId))
            self.assertEqual(seg.GetSegmentation().GetSegment(segmentId).GetName(), "the organ that secretes bile")
            self.assertEqual(len(boxes), len(anchor["boxes"]))
            p = logic.getParameterNode()
            geo = logic.geometry(volume)
            for node in boxes:
                c = [0.0, 0.0, 0.0]
                node.GetCenter(c)
                self.assertEqual(geo.slice_of(c), p.keySliceIJK)
            before = slicer.util.arrayFromSegmentBinaryLabelmap(seg, segmentId, volume).copy()

            self.delayDisplay("Moving a box and re-propagating")
            c = [0.0, 0.0, 0.0]
            boxes[0].GetCenter(c)
            step = geo.to_ras([4, 4, 0]) - geo.to_ras([0, 0, 0])
            boxes[0].SetCenter(*(np.array(c) + step))
            seg2, segmentId2, boxes2, anchor2 = logic.repropagateBlocking(options, timeout=600)
            self.assertEqual(segmentId2, segmentId)  # replaced, not added
            self.assertEqual(anchor2["source"], "user")
            self.assertEqual(anchor2["slice"], anchor["slice"])
            self.assertNotEqual(anchor2["boxes"][0], anchor["boxes"][0])
            after = slicer.util.arrayFromSegmentBinaryLabelmap(seg2, segmentId2, volume)
            self.assertEqual(after.shape, before.shape)
            self.assertEqual(seg2.GetSegmentation().GetNumberOfSegments(), 1)

            self.delayDisplay("Undo")
            self.assertTrue(logic.undoLastResult())
            restored = slicer.util.arrayFromSegmentBinaryLabelmap(seg2, segmentId2, volume)
            self.assertTrue(np.array_equal(restored, before))
        finally:
            logic.cleanup()
        self.delayDisplay("MedVol-R1 self-test passed")

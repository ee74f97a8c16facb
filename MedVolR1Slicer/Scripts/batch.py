"""Headless MedVol-R1 in Slicer: segment one CT or a manifest of CTs without a window.

    Slicer --no-main-window --python-script MedVolR1Slicer/Scripts/batch.py \\
        --input CT.nii.gz --query "the organ that secretes bile" --output liver.seg.nrrd [--preset tiny]
    Slicer --no-main-window --python-script MedVolR1Slicer/Scripts/batch.py --manifest jobs.csv --output-dir out/

Exits 0 when every case was segmented, 1 when one failed (or something unexpected went wrong),
2 on bad arguments; it always exits, whatever happens. Arguments, manifests and the summary live
in ``MedVolR1SlicerLib.batchjobs`` (tested there); this script only loads volumes, runs the
module's logic and saves nodes. Files are read and written through MRML storage nodes and the
Volumes module's logic, one fresh storage node per file, so each output is written in the format
its own name asks for.
"""

import contextlib
import json
import os
import shutil
import sys
import tempfile

# the module's folder (its parts are imported from there); this script lives in Scripts/ because
# Slicer loads every .py file at the top of a scripted module's folder as a module, at every start
MODULE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if MODULE_DIR not in sys.path:
    sys.path.insert(0, MODULE_DIR)

import slicer  # noqa: E402

from MedVolR1SlicerLib import batchjobs, params  # noqa: E402

SINGLE_FILE = 4  # vtkSlicerVolumesLogic::SingleFile: read this file only, never its neighbours

# DICOMScalarVolumePlugin's setting for a series with irregular geometry (gantry tilt, uneven slice
# spacing): "default"/"transform" put the volume under a grid transform, "hardenTransform" also
# hardens it (resamples the volume), "none" loads it distorted (DICOMScalarVolumePlugin.py:96-105,
# 143-149, 920-942 at Slicer 5.10.0 and 5.12.3). It is read at each load.
REGULARIZATION_KEY = "DICOM/ScalarVolume/AcquisitionGeometryRegularization"


def shown(text):
    """``text`` as it may reach a terminal: every control character (an escape sequence's ESC,
    a carriage return, a newline) written as its escape (``\\x1b``), so a query or a file name
    cannot move the cursor, retitle the window or fake another line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _write_atomic(path, write, overwrite):
    """``write(tmp)`` to a temporary name in ``path``'s folder (same suffix), then rename it to
    ``path`` (never half-written). Without ``overwrite`` a file that appeared at ``path`` since
    the batch checked its outputs is left alone and the case fails."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    name = os.path.basename(path)
    suffix = next((s for s in batchjobs.OUTPUT_SUFFIXES + (".json",) if name.lower().endswith(s)),
                  os.path.splitext(name)[1])
    tmp = os.path.join(folder, f".{name[:len(name) - len(suffix)]}.part-{os.getpid()}{suffix}")
    try:
        write(tmp)
        if not overwrite and os.path.lexists(path):
            raise batchjobs.BatchError(f"{path} appeared while this case ran; it was left as it is "
                                       "(pass --overwrite to replace it)")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _save(logic, node, path, overwrite=False):
    """Write a segmentation (``.seg.nrrd``) or label-map node to ``path`` (:func:`_write_atomic`)."""
    if node.IsA("vtkMRMLSegmentationNode"):
        _write_atomic(path, lambda tmp: logic.writeSegmentationFile(node, tmp), overwrite)
    else:
        _write_atomic(path, lambda tmp: logic.writeVolumeFile(node, tmp), overwrite)


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


@contextlib.contextmanager
def settings_kept(keys, overrides=None):
    """Slicer's application settings ``keys`` (and the keys of ``overrides``) exactly as they were
    once the block ends, however it ends: a value is put back, a key that was absent is removed
    again. ``overrides``: values in force during the block only."""
    import qt

    overrides = dict(overrides or {})
    settings = qt.QSettings()
    before = {k: (settings.contains(k), settings.value(k)) for k in list(keys) + list(overrides)}
    try:
        for k, v in overrides.items():
            settings.setValue(k, v)
        yield
    finally:
        settings = qt.QSettings()
        for k, (present, value) in before.items():
            if present:
                settings.setValue(k, value)
            else:
                settings.remove(k)


@contextlib.contextmanager
def temporary_dicom_database(DICOMUtils, directory):
    """``DICOMUtils.TemporaryDICOMDatabase(directory)``, leaving the user's DICOM database as it
    was whatever happens: its settings key (``slicer.dicomDatabaseDirectorySettingsKey``) and the
    database file ``slicer.dicomDatabase`` has open. Slicer's context manager alone puts the
    setting back only when there was one (``closeTemporaryDatabase`` returns early when the
    original is None, DICOMUtils.py:399-403 at 5.10.0 and 5.12.3), so without a setting before it
    would be left pointing at ``directory``, which the caller deletes; and it leaves
    ``slicer.dicomDatabase`` closed then, even if a database was open (Slicer's testing mode opens
    one without a setting, DICOM.py:338-340 at 5.12.3)."""
    db = getattr(slicer, "dicomDatabase", None)
    key = getattr(slicer, "dicomDatabaseDirectorySettingsKey", None)
    if db is None or not key:
        raise batchjobs.BatchError("Slicer's DICOM database is not set up (the DICOM module did not start); "
                                   "convert the series to NIfTI or NRRD first")
    was_open = bool(db.isOpen)
    filename = db.databaseFilename if was_open else ""
    with settings_kept([key]):
        try:
            with DICOMUtils.TemporaryDICOMDatabase(directory) as temporary:
                yield temporary
        finally:
            db = slicer.dicomDatabase
            if was_open and not (db.isOpen and db.databaseFilename == filename):
                if db.isOpen:
                    db.closeDatabase()
                db.openDatabase(filename)
            elif not was_open and db.isOpen:
                db.closeDatabase()


def on_regular_grid(volume, loaded):
    """Take ``volume`` out from under the transform it was loaded under (hardened: a linear one
    into its IJK→RAS, a non-linear one, e.g. Slicer's acquisition grid transform, by resampling
    its voxels, vtkMRMLTransformableNode::HardenTransform) so that it lies on one regular grid in
    RAS, as the module's logic needs. ``loaded``: the other nodes the load added (the caller
    removes them). Returns what was done, for the log ("" when nothing was needed)."""
    parent = volume.GetParentTransformNode()
    if parent is None:
        transforms = [n for n in loaded if n.IsA("vtkMRMLTransformNode")]
        if not transforms:
            return ""
        return (f"irregular acquisition geometry: Slicer's DICOM module resampled the series onto a regular grid "
                f"(hardened its transform {transforms[0].GetName()!r})")
    linear = bool(parent.IsTransformToWorldLinear())
    image = volume.GetImageData()
    if not volume.HardenTransform() or volume.GetParentTransformNode() is not None or (
            not linear and volume.GetImageData() is image):
        raise RuntimeError(f"could not harden the transform {parent.GetName()!r} the DICOM series was loaded under")
    how = "into its geometry (no resampling)" if linear else "by resampling it onto a regular grid"
    return f"the series was loaded under the transform {parent.GetName()!r} ({parent.GetClassName()}); hardened it {how}"


def load_dicom_series(folder):
    """The one scalar volume in a DICOM series folder, loaded through Slicer's DICOM module
    into a temporary database (the user's database and its setting are left as they were).
    A series with irregular geometry is loaded regularized (resampled onto a regular grid by the
    DICOM module, with its regularization setting set to "hardenTransform" for this load only),
    and a volume still under a transform is hardened; the log says which. Refuses, with a
    message, folders holding several series and Slicers without the DICOM module."""
    try:
        from DICOMLib import DICOMUtils
    except ImportError:
        raise batchjobs.BatchError(
            f"{folder} is a DICOM folder, and loading DICOM needs Slicer's DICOM module, which is not available "
            "here; convert the series to NIfTI or NRRD first") from None
    scene = slicer.mrmlScene
    dbdir = tempfile.mkdtemp(prefix="medvol-dicom-")
    try:
        with temporary_dicom_database(DICOMUtils, dbdir) as db:
            DICOMUtils.importDicom(str(folder), db)
            series = [s for pat in db.patients() for st in db.studiesForPatient(pat) for s in db.seriesForStudy(st)]
            if not series:
                raise batchjobs.BatchError(f"Slicer's DICOM module found no image series in {folder}")
            if len(series) > 1:
                raise batchjobs.BatchError(f"{folder} holds {len(series)} DICOM series; give a folder with one series")
            with settings_kept([], {REGULARIZATION_KEY: "hardenTransform"}):
                nodes = [scene.GetNodeByID(i) for i in DICOMUtils.loadSeriesByUID(series)]
    finally:
        shutil.rmtree(dbdir, ignore_errors=True)
    nodes = [n for n in nodes if n is not None]
    volumes = [n for n in nodes if n.IsA("vtkMRMLScalarVolumeNode") and not n.IsA("vtkMRMLLabelMapVolumeNode")]
    try:
        if len(volumes) != 1:
            raise batchjobs.BatchError(f"the DICOM series in {folder} loaded as {len(volumes)} volumes, not one")
        done = on_regular_grid(volumes[0], [n for n in nodes if n is not volumes[0]])  # before its transform goes
    except BaseException:
        for n in nodes:
            if n.GetScene() is not None:
                scene.RemoveNode(n)
        raise
    for n in nodes:
        if n is not volumes[0] and n.GetScene() is not None:
            scene.RemoveNode(n)
    if done:
        print(f"  DICOM: {done}", flush=True)
    return volumes[0]


def load_input(path):
    """The input volume node: a volume file through the Volumes logic, a DICOM series folder
    through the DICOM module. A single DICOM file or a folder without DICOM is refused."""
    kind = batchjobs.input_kind(path)
    if kind == "dicom_folder":
        return load_dicom_series(path)
    name = os.path.basename(str(path)).split(".")[0] or "CT"
    node = slicer.modules.volumes.logic().AddArchetypeVolume(str(path), name, SINGLE_FILE)
    if node is None or node.GetImageData() is None:
        raise OSError(f"cannot read {path} as a volume (NIfTI, NRRD, MetaImage, … or a DICOM series folder)")
    return node


def run_job(logic, job, options, anchor_dir, overwrite=False):
    """Segment one case and write its output (and anchor, named by
    :func:`batchjobs.anchor_path`). Removes every node it added. ``overwrite``: replace a file
    that exists (the batch checked up front that none is an input or another row's file).
    Returns ``"done"``, or ``"absent"`` when the model answered that the target is not in this CT:
    then no output is written (the anchor is, when asked for: it records the answer)."""
    volume = load_input(job.input)
    added = []
    try:
        seg, segment_id, rois, anchor = logic.segmentBlocking(volume, job.query, options)
        if anchor.get("absent"):
            if anchor_dir:
                path = str(batchjobs.anchor_path(anchor_dir, job))
                _write_atomic(path, lambda tmp: _write_json(tmp, anchor), overwrite)
            return "absent"
        added += [seg] + list(rois)
        if job.as_labelmap:
            label = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLLabelMapVolumeNode")
            added.append(label)
            if not slicer.modules.segmentations.logic().ExportSegmentsToLabelmapNode(seg, [segment_id], label, volume):
                raise RuntimeError(f"could not turn the segment into a label map for {job.output}")
            _save(logic, label, str(job.output), overwrite)
        else:
            _save(logic, seg, str(job.output), overwrite)
        if anchor_dir:
            path = str(batchjobs.anchor_path(anchor_dir, job))
            _write_atomic(path, lambda tmp: _write_json(tmp, anchor), overwrite)
        return "done"
    finally:
        for node in added + [volume]:
            if node is not None and node.GetScene() is not None:
                slicer.mrmlScene.RemoveNode(node)


def main(argv, logic=None):
    """Run the batch; returns the exit code (0 all done, 1 a case failed, 2 bad arguments).
    Never raises: whatever goes wrong is one line on stderr and a code. ``logic``: a
    ``MedVolR1SlicerLogic`` to use (and leave running); by default a new one, cleaned up here."""
    try:
        args = batchjobs.parse_args(argv)
        jobs = batchjobs.jobs_from_args(args)
        batchjobs.check_inputs(jobs)
        # every row's output and anchor against every file the batch reads, before anything runs
        batchjobs.check_outputs(jobs, args.overwrite, args.anchor_dir,
                                reads=[("the manifest", args.manifest), ("the token file", args.token_file)])
        token = batchjobs.read_token_file(args.token_file) if args.token_file else ""
        options = params.options_from_panel(args.preset, args.adapter, args.device, args.window,
                                            "remote" if args.worker_url else "local", args.worker_url, token,
                                            consensus=args.consensus)
        if args.threads is not None:  # the local worker's; otherwise it decides (medvolcore.cpu)
            options.extra_worker_args = ["--threads", str(args.threads)]
    except SystemExit as e:  # argparse already printed its message
        return 2 if e.code not in (0, None) else 0
    except (batchjobs.BatchError, ValueError, OSError) as e:
        print(f"medvol batch (Slicer): error: {e}", file=sys.stderr)
        return 2

    results, absent = [], []
    try:
        own = logic is None
        if own:
            from MedVolR1SlicerScene.logic import MedVolR1SlicerLogic  # the logic alone: no panel, no Qt

            logic = MedVolR1SlicerLogic()
        try:
            for i, job in enumerate(jobs, 1):
                print(f"[{i}/{len(jobs)}] {shown(job.input.name)}: {shown(job.query)}", flush=True)
                try:
                    if run_job(logic, job, options, args.anchor_dir, args.overwrite) == "absent":
                        absent.append(job)
                        print(f"  not found in this CT: {shown(job.query)} (no output written)", flush=True)
                    results.append((job, None))
                except Exception as e:  # noqa: BLE001 - one case's failure, whatever it is, is reported
                    known = isinstance(e, (batchjobs.BatchError, ValueError, OSError, RuntimeError))
                    results.append((job, str(e) if known else f"{type(e).__name__}: {e}"))
                    print(f"  failed: {shown(results[-1][1])}", file=sys.stderr, flush=True)
                    if not args.keep_going:
                        break
        finally:
            if own:
                logic.cleanup()
    except Exception as e:  # noqa: BLE001 - outside any case: still one line and a code
        print(f"medvol batch (Slicer): error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    text, code = batchjobs.summary(results, absent)
    if len(results) < len(jobs):
        text += f"\n  not run: {len(jobs) - len(results)} (stopped at the first failure; --keep-going goes on)"
        code = 1
    print("\n".join(shown(line) for line in text.split("\n")), flush=True)
    return code


def run_script(argv):
    """What ``--python-script`` runs: :func:`main`, then always ``slicer.util.exit`` with its
    code (a script that stops on an exception leaves a headless Slicer running for ever)."""
    code = 1
    try:
        code = main(argv)
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: exit, never hang
        print(f"medvol batch (Slicer): error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        slicer.util.exit(code)
    return code


if __name__ == "__main__":
    run_script(sys.argv[1:])

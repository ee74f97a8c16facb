"""``batch.py``'s DICOM path on real MRML (slicer-core): the user's DICOM database setting is left
as it was, and a series loaded under a transform (Slicer's acquisition-geometry grid transform, or
a linear one) comes back on one regular grid, the transform gone from the scene.

slicer-core has no DICOM module (no ``ctkDICOMDatabase``, no ``DICOMLib``), so the part of it that
``batch.py`` uses is a stand-in here, written after Slicer 5.10.0's and 5.12.3's
``Modules/Scripted/DICOMLib/DICOMUtils.py`` (identical there for these functions):
``openTemporaryDatabase`` (351-380), ``closeTemporaryDatabase`` (383-415, which returns early
without touching the setting when there was none, 399-403), ``TemporaryDICOMDatabase`` (466-481),
``importDicom`` and ``loadSeriesByUID``, returning the IDs of every node added to the scene but
storage and display nodes (``loadLoadables``, 859-867). The scalar-volume plugin's acquisition
transform is made as ``DICOMScalarVolumePlugin.py`` makes it (a ``vtkMRMLGridTransformNode`` with a
``vtkOrientedGridTransform``, 798-839; added unless the regularization setting is "none", hardened
when it is "hardenTransform", 143-149 and 920-942). ``qt.QSettings`` is a dict shared by every
instance. The volumes, transforms and hardening are Slicer's own.
"""

from __future__ import annotations

import os
import sys
import types
import typing

import numpy as np
import pytest

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py
import vtk  # noqa: E402

KEY = "DatabaseDirectory_0.8.0"  # slicer.dicomDatabaseDirectorySettingsKey ("DatabaseDirectory_" + schema)
REGULARIZATION = "DICOM/ScalarVolume/AcquisitionGeometryRegularization"


# ---- stand-ins for what the Slicer application's DICOM module provides -----------------------

class Settings:
    """``qt.QSettings``: every instance reads and writes the same store (``store`` is set per test)."""

    store: typing.ClassVar[dict] = {}

    def value(self, key, default=None):
        return self.store.get(key, default)

    def setValue(self, key, value):
        self.store[key] = value

    def contains(self, key):
        return key in self.store

    def remove(self, key):
        self.store.pop(key, None)


class Database:
    """``ctkDICOMDatabase``: open/closed, its file, and the series ``importDicom`` indexed."""

    def __init__(self):
        self.isOpen, self.databaseFilename, self.series = False, "", []

    def openDatabase(self, filename):
        self.isOpen, self.databaseFilename = True, filename

    def closeDatabase(self):
        self.isOpen = False

    def initializeDatabase(self):
        self.series = []

    def patients(self):
        return ["patient"] if self.series else []

    def studiesForPatient(self, patient):
        return ["study"]

    def seriesForStudy(self, study):
        return list(self.series)


def _dicom_utils(series_in_folder, plugin_load):
    """``DICOMLib.DICOMUtils`` as at Slicer 5.10.0/5.12.3, for what ``batch.py`` calls."""
    import qt

    m = types.ModuleType("DICOMLib.DICOMUtils")

    def openDatabase(databaseDir):
        if not os.access(databaseDir, os.F_OK):
            return False
        slicer.dicomDatabase.openDatabase(databaseDir + "/ctkDICOM.sql")
        return slicer.dicomDatabase.isOpen

    def openTemporaryDatabase(directory=None):
        os.makedirs(directory, exist_ok=True)
        settings = qt.QSettings()
        originalDatabaseDir = settings.value(slicer.dicomDatabaseDirectorySettingsKey)
        settings.setValue(slicer.dicomDatabaseDirectorySettingsKey, directory)
        openDatabase(directory)
        slicer.dicomDatabase.initializeDatabase()
        return originalDatabaseDir

    def closeTemporaryDatabase(originalDatabaseDir, cleanup=True):
        if slicer.dicomDatabase.isOpen:
            if cleanup:
                slicer.dicomDatabase.initializeDatabase()
            slicer.dicomDatabase.closeDatabase()
        if originalDatabaseDir is None:
            return True  # the setting still names the temporary folder
        settings = qt.QSettings()
        settings.setValue(slicer.dicomDatabaseDirectorySettingsKey, originalDatabaseDir)
        if os.access(originalDatabaseDir, os.F_OK):
            return openDatabase(originalDatabaseDir)
        return True

    class TemporaryDICOMDatabase:
        def __init__(self, directory=None):
            self.temporaryDatabaseDir = directory
            self.originalDatabaseDir = None

        def __enter__(self):
            self.originalDatabaseDir = openTemporaryDatabase(self.temporaryDatabaseDir)
            return slicer.dicomDatabase

        def __exit__(self, type, value, traceback):
            closeTemporaryDatabase(self.originalDatabaseDir)

    def importDicom(dicomDataDir, dicomDatabase=None, copyFiles=False):
        (dicomDatabase or slicer.dicomDatabase).series = list(series_in_folder)
        return True

    def loadSeriesByUID(seriesUIDs, messages=None, progressCallback=None, enabledPluginClassNames=None):
        if not isinstance(seriesUIDs, list) or not seriesUIDs:
            raise ValueError("SeriesUIDs must contain a list")
        if not slicer.dicomDatabase.isOpen:
            raise OSError("DICOM module or database cannot be accessed")
        scene = slicer.mrmlScene
        before = {scene.GetNthNode(i).GetID() for i in range(scene.GetNumberOfNodes())}
        plugin_load()
        added = [scene.GetNthNode(i) for i in range(scene.GetNumberOfNodes())]
        return [n.GetID() for n in added if n.GetID() not in before
                and not n.IsA("vtkMRMLStorageNode") and not n.IsA("vtkMRMLDisplayNode")]

    for f in (openDatabase, openTemporaryDatabase, closeTemporaryDatabase, TemporaryDICOMDatabase, importDicom,
              loadSeriesByUID):
        setattr(m, f.__name__, f)
    return m


@pytest.fixture
def dicom(slicer_env, monkeypatch, tmp_path):
    """Slicer's DICOM module as far as ``batch.py`` uses it. ``dicom.load`` is the plugin's load
    (set by each test), ``dicom.series`` what a folder import finds."""
    ns = types.SimpleNamespace(series=["1.2.3.4"], load=None, store={}, db=Database(),
                               folder=tmp_path / "series")
    ns.folder.mkdir()
    monkeypatch.setattr(Settings, "store", ns.store)
    # batch.py reads the DICOM module's settings through Slicer's Qt; this tier has no Qt, so the
    # test gives it a qt module holding only the settings store (the logic never imports qt)
    monkeypatch.setitem(sys.modules, "qt", types.SimpleNamespace(QSettings=Settings))
    monkeypatch.setattr(slicer, "dicomDatabase", ns.db, raising=False)
    monkeypatch.setattr(slicer, "dicomDatabaseDirectorySettingsKey", KEY, raising=False)
    package = types.ModuleType("DICOMLib")
    package.DICOMUtils = _dicom_utils(ns.series, lambda: ns.load())
    monkeypatch.setitem(sys.modules, "DICOMLib", package)
    monkeypatch.setitem(sys.modules, "DICOMLib.DICOMUtils", package.DICOMUtils)
    return ns


@pytest.fixture
def batch(slicer_env):
    import batch as batch_module

    return batch_module


def _matrix(a):
    m = vtk.vtkMatrix4x4()
    for r in range(4):
        for c in range(4):
            m.SetElement(r, c, float(a[r][c]))
    return m


def _ijk_to_ras(node):
    m = vtk.vtkMatrix4x4()
    node.GetIJKToRASMatrix(m)
    return slicer.util.arrayFromVTKMatrix(m)


# an LPS-stored CT: i runs to patient right… as DICOM slices do (spacing 0.8, 0.8, 2.5 mm)
M0 = np.array([[-0.8, 0, 0, 40.0], [0, -0.8, 0, 30.0], [0, 0, 2.5, -100.0], [0, 0, 0, 1]])
VOXELS = (np.arange(5 * 6 * 7).reshape(5, 6, 7) * 3 + 7).astype(np.int16)  # (k, j, i)


def _add_volume(arr=VOXELS, ijk_to_ras=M0):
    """What the scalar-volume plugin's reader adds: a volume node with its voxels and geometry."""
    node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLScalarVolumeNode", "3: CT")
    image = vtk.vtkImageData()
    image.SetDimensions(arr.shape[2], arr.shape[1], arr.shape[0])
    image.AllocateScalars(vtk.VTK_SHORT, 1)
    node.SetAndObserveImageData(image)
    node.SetIJKToRASMatrix(_matrix(ijk_to_ras))
    slicer.util.updateVolumeFromArray(node, arr)
    node.CreateDefaultDisplayNodes()
    return node


def _acquisition_transform(volume, shift_per_slice):
    """The plugin's grid transform (DICOMScalarVolumePlugin.gridTransformFromCorners): one
    displacement at each corner of each slice, here a tilted gantry's shear, every slice moved by
    ``shift_per_slice`` (RAS mm) more than the one before."""
    columns, rows, slices = volume.GetImageData().GetDimensions()
    grid = slicer.vtkMRMLGridTransformNode()
    grid.SetName(slicer.mrmlScene.GenerateUniqueName(volume.GetName() + " acquisition transform"))
    slicer.mrmlScene.AddNode(grid)
    image = vtk.vtkImageData()
    image.SetOrigin(*volume.GetOrigin())
    image.SetDimensions(2, 2, slices)
    sx, sy, sz = volume.GetSpacing()
    image.SetSpacing(sx * columns, sy * rows, sz)
    image.AllocateScalars(vtk.VTK_DOUBLE, 3)
    transform = slicer.vtkOrientedGridTransform()
    direction = vtk.vtkMatrix4x4()
    volume.GetIJKToRASDirectionMatrix(direction)
    transform.SetGridDirectionMatrix(direction)
    transform.SetDisplacementGridData(image)
    grid.SetAndObserveTransformToParent(transform)
    volume.SetAndObserveTransformNodeID(grid.GetID())
    displacements = slicer.util.arrayFromGridTransform(grid)
    for k in range(slices):
        displacements[k] = np.asarray(shift_per_slice, float) * k
    return grid


def _snapshot(ns):
    return dict(ns.store), ns.db.isOpen, ns.db.databaseFilename if ns.db.isOpen else ""


def _user_states(ns, tmp_path):
    """The three states a user's DICOM database can be in, each set up in turn."""
    userdb = tmp_path / "SlicerDICOMDatabase"
    userdb.mkdir()

    def with_setting():  # a production Slicer: the DICOM module always writes one (DICOM.py:343-350 at 5.12.3)
        ns.store.clear()
        ns.store.update({KEY: str(userdb), REGULARIZATION: "transform", "Other/Key": "1"})
        ns.db.openDatabase(str(userdb) + "/ctkDICOM.sql")

    def no_setting_database_open():  # Slicer's testing mode opens one without a setting (DICOM.py:338-340)
        ns.store.clear()
        ns.store["Other/Key"] = "1"
        ns.db.openDatabase(str(tmp_path / "testing-db") + "/ctkDICOM.sql")

    def no_setting_no_database():
        ns.store.clear()
        ns.db.closeDatabase()

    return [("a database setting", with_setting), ("no setting, a database open", no_setting_database_open),
            ("no setting, no database", no_setting_no_database)]


# ---- (a) the user's DICOM database ------------------------------------------------------------

def test_a_dicom_load_leaves_the_users_dicom_database_and_its_setting_as_they_were(batch, scene, dicom, tmp_path):
    dicom.load = _add_volume
    for what, set_up in _user_states(dicom, tmp_path):
        set_up()
        before = _snapshot(dicom)
        volume = batch.load_dicom_series(dicom.folder)
        assert volume.IsA("vtkMRMLScalarVolumeNode")
        assert _snapshot(dicom) == before, what  # the setting back, or absent again; the same file open
        scene.RemoveNode(volume)


def test_a_failed_dicom_load_also_leaves_the_users_dicom_database_as_it_was(batch, scene, dicom, tmp_path):
    def broken():
        _add_volume()
        raise OSError("DICOM module or database cannot be accessed")

    for what, set_up in _user_states(dicom, tmp_path):
        for load, series, message in ((broken, ["1.2.3.4"], "cannot be accessed"),
                                      (_add_volume, ["1.2.3.4", "1.2.3.5"], "holds 2 DICOM series")):
            set_up()
            dicom.load, dicom.series[:] = load, series
            before = _snapshot(dicom)
            with pytest.raises(Exception, match=message):
                batch.load_dicom_series(dicom.folder)
            assert _snapshot(dicom) == before, (what, message)


# ---- (b) a volume loaded under a linear transform ----------------------------------------------

def test_a_series_loaded_under_a_linear_transform_comes_back_hardened(batch, scene, dicom, slicer_env, capsys):
    c, s = np.cos(np.radians(12)), np.sin(np.radians(12))
    T = np.array([[c, -s, 0, 5.0], [s, c, 0, -3.0], [0, 0, 1, 12.0], [0, 0, 0, 1]])
    ids = {}

    def load():
        volume = _add_volume()
        transform = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLLinearTransformNode", "acquisition")
        transform.SetMatrixTransformToParent(_matrix(T))
        volume.SetAndObserveTransformNodeID(transform.GetID())
        ids["transform"] = transform.GetID()

    dicom.load = load
    volume = batch.load_dicom_series(dicom.folder)
    assert volume.GetParentTransformNode() is None and not volume.GetTransformNodeID()
    np.testing.assert_allclose(_ijk_to_ras(volume), T @ M0, atol=1e-9)
    np.testing.assert_array_equal(slicer.util.arrayFromVolume(volume), VOXELS)
    assert scene.GetNodeByID(ids["transform"]) is None
    assert scene.GetNodesByClass("vtkMRMLTransformNode").GetNumberOfItems() == 0
    slicer_env.MedVolR1SlicerLogic.geometry(volume)  # the module's logic takes it (it refuses a transformed one)
    assert "hardened it into its geometry (no resampling)" in capsys.readouterr().out
    assert dicom.store == {}  # nothing left in the settings


# ---- (c) Slicer's acquisition-geometry grid transform -------------------------------------------

SHIFT = (-0.8, 0.0, 0.0)  # RAS mm per slice: one voxel along +i per slice (a tilted gantry's shear)


def _check_sheared(volume):
    """The volume lies on one regular grid (same axes and spacing as the acquisition's) holding
    the acquired voxels where the acquisition put them: voxel (i, j, k) of the series at
    M0·(i, j, k) + k·SHIFT."""
    assert volume.GetParentTransformNode() is None
    m = _ijk_to_ras(volume)
    np.testing.assert_allclose(m[:3, :3], M0[:3, :3], atol=1e-9)
    out = slicer.util.arrayFromVolume(volume)
    nk, nj, ni = VOXELS.shape
    assert out.shape == (nk, nj, ni + nk - 1)  # widened by the shear, resampled
    k, j, i = np.meshgrid(*(np.arange(n) for n in out.shape), indexing="ij")
    ras = np.einsum("ab,bkji->akji", m, np.stack([i, j, k, np.ones_like(i)]).astype(float))
    src = np.einsum("ab,bkji->akji", np.linalg.inv(M0), ras - np.array(SHIFT + (0,))[:, None, None, None] * k)
    idx = np.rint(src[:3]).astype(int)
    np.testing.assert_allclose(src[:3], idx, atol=1e-6)  # output voxels sit on acquired voxels
    inside = np.all((idx >= 0) & (idx < np.array([ni, nj, nk])[:, None, None, None]), axis=0)
    assert int(inside.sum()) == VOXELS.size  # every acquired voxel is there once
    np.testing.assert_array_equal(out[inside], VOXELS[idx[2][inside], idx[1][inside], idx[0][inside]])


@pytest.mark.parametrize("users_choice", [None, "none", "transform"])
def test_a_series_with_irregular_geometry_is_resampled_by_the_dicom_module_and_the_setting_kept(
        batch, scene, dicom, users_choice, capsys):
    """As the plugin does: the grid transform unless the setting says "none", hardened when it
    says "hardenTransform" — which the batch asks for, for this load only."""
    import qt

    seen = []

    def plugin_load():
        choice = qt.QSettings().value(REGULARIZATION, "default")
        seen.append(choice)
        volume = _add_volume()
        if choice != "none":
            _acquisition_transform(volume, SHIFT)
            if choice == "hardenTransform":
                volume.HardenTransform()

    if users_choice is not None:
        dicom.store[REGULARIZATION] = users_choice
    before = dict(dicom.store)
    dicom.load = plugin_load
    volume = batch.load_dicom_series(dicom.folder)
    _check_sheared(volume)
    assert seen == ["hardenTransform"]
    assert scene.GetNodesByClass("vtkMRMLTransformNode").GetNumberOfItems() == 0  # the grid transform is gone
    assert "Slicer's DICOM module resampled the series onto a regular grid" in capsys.readouterr().out
    assert dicom.store == before  # the user's choice (or its absence) is back


def test_a_volume_left_under_the_grid_transform_is_hardened_by_resampling(batch, scene, dicom, slicer_env, capsys):
    """A DICOM plugin that leaves the volume under its grid transform (whatever the setting):
    the batch hardens it itself, Slicer resampling the voxels onto a regular grid."""
    def plugin_load():
        _acquisition_transform(_add_volume(), SHIFT)

    dicom.load = plugin_load
    volume = batch.load_dicom_series(dicom.folder)
    _check_sheared(volume)
    assert scene.GetNodesByClass("vtkMRMLTransformNode").GetNumberOfItems() == 0
    slicer_env.MedVolR1SlicerLogic.geometry(volume)
    out = capsys.readouterr().out
    assert "(vtkMRMLGridTransformNode); hardened it by resampling it onto a regular grid" in out
    assert dicom.store == {}

"""The module on a clinician's second day, in the panel (real Qt over real MRML): the worker is an
application setting and a scene never chooses it; the first CT sent to an address asks first,
naming the address and what the server says it is; a token goes only to the address it was
typed for; Show 3D follows the result. The worker is the module's self-test worker (conftest.py),
local or "remote" alike; ``Workers.options`` records what each client was made for."""

from __future__ import annotations

import pytest

pytest.importorskip("PyQt5.QtWidgets", reason="PyQt5 is not installed (bootstrap.py --no-pyqt)")
pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
from PyQt5 import QtCore  # noqa: E402
from PyQt5.QtCore import Qt  # noqa: E402
from steps import click, idle, key, load_ct, segment, type_text, wait_until  # noqa: E402

SCENE_HOST = "http://scene-host:8765"


def replace_text(widget, text):
    """Select all in a line edit and type ``text`` (one textChanged per key, as a user types)."""
    widget.setFocus()
    key(widget, Qt.Key_A, Qt.ControlModifier)
    type_text(widget, text)


def choose_remote(panel, url):
    ui = panel.ui
    if ui.advancedCollapsibleButton.collapsed:
        click(ui.advancedCollapsibleButton)
    click(ui.workerRemoteRadioButton)
    replace_text(ui.remoteUrlLineEdit, url)


def type_query(panel, query):
    replace_text(panel.ui.queryEdit, query)


def segment_nodes(panel):
    return panel.slicer.mrmlScene.GetNodesByClass("vtkMRMLSegmentationNode").GetNumberOfItems()


@pytest.fixture
def installed(monkeypatch):
    """The local worker's packages count as installed (nothing is installed here)."""
    import types

    from MedVolR1SlicerLib import install

    monkeypatch.setattr(install, "current_plan", lambda *a, **k: types.SimpleNamespace(needed=False))


def test_a_scene_saved_with_a_remote_worker_never_chooses_where_the_next_ct_goes(panel, tmp_path, installed):
    """The issue's second day: a scene saved (by a version that kept the worker in the scene)
    while a remote worker was in use; the clinician switches back to Local, closes the scene, opens
    it again, loads another patient and clicks Segment. The CT stays here, and the token typed
    earlier in the session goes nowhere."""
    slicer, ui = panel.slicer, panel.ui
    scene = slicer.mrmlScene
    load_ct(panel, "PatientA_CT")
    choose_remote(panel, SCENE_HOST)
    type_text(ui.remoteTokenLineEdit, "typed-earlier")
    node = scene.GetSingletonNode("MedVolR1Slicer", "vtkMRMLScriptedModuleNode")
    for name, value in (("worker", "remote"), ("remoteUrl", SCENE_HOST)):  # as the older version saved them
        node.SetParameter(name, value)
    saved = tmp_path / "PatientA.mrml"
    scene.SetURL(str(saved))
    assert scene.Commit() and SCENE_HOST in saved.read_text(encoding="utf-8")

    click(ui.workerLocalRadioButton)
    scene.Clear(0)  # File → Close scene
    ui.statusLabel.text = ""
    scene.SetURL(str(saved))  # File → Load scene: the saved one
    assert scene.Import()
    assert ui.workerLocalRadioButton.checked and not ui.workerRemoteRadioButton.checked
    status = ui.statusLabel.text
    assert "older MedVol-R1" in status and SCENE_HOST in status and "ignored" in status
    assert not node.HasParameter("worker") and not node.HasParameter("remoteUrl")

    load_ct(panel, "PatientB_CT")  # the next patient
    segment(panel, "the organ")
    assert [(o.worker, o.remote_url, o.remote_token) for o in panel.workers.options] == [("local", "", "")]
    assert [text for text, _ in panel.dialogs.shown] == []  # nothing was about to be sent away
    panel.window.showModule("SegmentEditor")
    panel.window.showModule("MedVolR1Slicer")
    assert ui.statusLabel.text.startswith("Done.")  # said once
    resaved = tmp_path / "PatientB.mrml"
    scene.SetURL(str(resaved))
    assert scene.Commit() and "scene-host" not in resaved.read_text(encoding="utf-8")


def test_the_worker_choice_and_address_are_application_settings(panel):
    ui = panel.ui
    choose_remote(panel, "http://gpu-a:8765")
    settings = QtCore.QSettings()
    assert settings.value("MedVolR1Slicer/Worker") == "remote"
    assert settings.value("MedVolR1Slicer/RemoteUrl") == "http://gpu-a:8765"
    node = panel.slicer.mrmlScene.GetSingletonNode("MedVolR1Slicer", "vtkMRMLScriptedModuleNode")
    names = node.GetParameterNamesAsCommaSeparatedList().split(",")
    assert "worker" not in names and "remoteUrl" not in names  # nothing of it in the scene
    type_text(ui.remoteTokenLineEdit, "never-written")
    settings.sync()
    assert "never-written" not in open(settings.fileName(), encoding="utf-8").read()
    click(ui.workerLocalRadioButton)  # and a new panel (the next Slicer session) reads them
    settings.setValue("MedVolR1Slicer/Worker", "remote")
    settings.setValue("MedVolR1Slicer/RemoteUrl", "http://gpu-b:8765")
    panel.widget._loadWorkerSettings()
    assert ui.workerRemoteRadioButton.checked and ui.remoteUrlLineEdit.text == "http://gpu-b:8765"
    assert ui.remoteTokenLineEdit.text == ""


def test_the_first_ct_sent_to_an_address_asks_naming_it_and_what_the_server_says_it_is(panel):
    ui = panel.ui
    load_ct(panel)
    choose_remote(panel, "http://gpu-a:8765")
    type_query(panel, "the organ")
    panel.dialogs.plan("Do not send")
    click(ui.segmentButton)
    (worker,) = panel.workers.made
    assert [op for op, _ in worker.requests] == ["hello"]  # asked what it is; no CT was sent
    (text, buttons), = panel.dialogs.shown
    assert "http://gpu-a:8765" in text and "MedVolCore self-test" in text and "self-test worker" in text
    assert buttons == ["Do not send", "Send"]
    assert ui.statusLabel.text == "Nothing was sent to http://gpu-a:8765." and idle(panel)
    assert segment_nodes(panel) == 0

    panel.dialogs.plan("Send")  # a "no" is not remembered: asked again
    click(ui.segmentButton)
    wait_until(lambda: idle(panel))
    assert [op for op, _ in worker.requests] == ["hello", "hello", "load", "segment"]
    assert segment_nodes(panel) == 1 and ui.statusLabel.text.startswith("Done.")

    type_query(panel, "the organ again")  # the address is confirmed for the session: no question
    click(ui.segmentButton)
    wait_until(lambda: idle(panel))
    assert [op for op, _ in worker.requests][-1] == "segment" and len(panel.dialogs.shown) == 2

    replace_text(ui.remoteUrlLineEdit, "http://gpu-b:8765")  # another address asks again
    type_query(panel, "the organ once more")
    panel.dialogs.plan("Send")
    click(ui.segmentButton)
    wait_until(lambda: idle(panel))
    assert "http://gpu-b:8765" in panel.dialogs.shown[-1][0] and len(panel.dialogs.shown) == 3
    assert [op for op, _ in panel.workers.made[-1].requests] == ["hello", "load", "segment"]


def test_a_token_is_sent_only_to_the_address_it_was_typed_for(panel):
    ui = panel.ui
    load_ct(panel)
    choose_remote(panel, "http://gpu-a:8765")
    type_text(ui.remoteTokenLineEdit, "token-for-a")
    replace_text(ui.remoteUrlLineEdit, "http://gpu-b:8765")
    assert ui.remoteTokenLineEdit.text == ""
    assert "The token was typed for http://gpu-a:8765" in ui.statusLabel.text
    panel.dialogs.plan("Send")
    segment(panel, "the organ")
    replace_text(ui.remoteUrlLineEdit, "http://gpu-a:8765")  # back: its token is back
    assert ui.remoteTokenLineEdit.text == "token-for-a"
    panel.dialogs.plan("Send", "Keep both")
    click(ui.segmentButton)
    wait_until(lambda: idle(panel))
    made = {(o.remote_url, o.remote_token) for o in panel.workers.options}
    assert made == {("http://gpu-b:8765", ""), ("http://gpu-a:8765", "token-for-a")}


def test_show_3d_follows_the_results_segmentation(panel):
    """Show 3D says whether the result's segmentation has a closed surface: a new result in a new
    segmentation, or a closed scene, leaves it unchecked; a surface made elsewhere checks it."""
    from steps import use_remote_worker

    slicer, ui = panel.slicer, panel.ui
    load_ct(panel)
    use_remote_worker(panel)
    segment(panel, "the organ")
    p = panel.logic.getParameterNode()
    first = p.outputSegmentation
    assert not ui.show3DCheckBox.checked
    click(ui.show3DCheckBox)
    assert ui.show3DCheckBox.checked and first.GetSegmentation().ContainsRepresentation("Closed surface")
    ui.outputSegmentationSelector.setCurrentNode(None)  # "Create new segmentation"
    segment(panel, "the organ again")
    assert p.outputSegmentation is not first and not ui.show3DCheckBox.checked
    p.outputSegmentation.CreateClosedSurfaceRepresentation()  # e.g. the Segment Editor's Show 3D
    assert ui.show3DCheckBox.checked
    slicer.mrmlScene.Clear(0)
    assert not ui.show3DCheckBox.checked

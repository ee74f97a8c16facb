"""The web viewer clinicians use, in a real browser: a real Orthanc holding the sample series, the
worker in MONAI Label mode serving the prebuilt OHIF viewer (from the ``monailabel`` wheel) with its
DICOMweb through the worker, and Debian's Chromium driven by Playwright (no browser download).
The test opens the study, connects MONAI Label's panel, types the query in its options, runs the
model and sees the segmentation drawn over the CT (screenshot pixels); then a query for a structure
the model answers "not present" shows "not found".

The model is the untrained ``tiny`` preset (its result is meaningless, and the page says so). Its
grammar never answers "not present", so for the second query only, the model's answer text is
replaced by an absent answer, as the command-line tests of "not present" do; everything else is the
product's own path.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from core.test_pacs import STUDY, orthanc, source_series  # noqa: F401 - the Orthanc fixtures

pytestmark = [pytest.mark.slow, pytest.mark.browser]
CHROMIUM = Path("/usr/bin/chromium")
ABSENT = "<think>no cyst on any shown slice</think><answer>[]</answer>"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-dev-shm-usage", "--disable-extensions", "--no-first-run", "--disable-sync",
         "--disable-component-update", "--disable-default-apps", "--mute-audio"]


def _why_not() -> str:
    from medvolcore.serve.monailabel import default_ohif_dir

    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (python3 MedVolCore/bootstrap.py installs it unless --no-browser)"
    if not CHROMIUM.exists():
        return "Debian's chromium is not installed (apt-get install chromium, or bootstrap.py as root)"
    if default_ohif_dir() is None:
        return "the OHIF viewer is not installed (bootstrap.py installs the monailabel wheel without its dependencies)"
    return ""


@pytest.fixture
def viewer_worker(orthanc, tmp_path, monkeypatch):  # noqa: F811
    """The worker with ``--monailabel orthanc`` in this process (so the second query's answer can
    be replaced), on a free loopback port."""
    if _why_not():
        pytest.skip(_why_not())
    from medvolcore import pacs
    from medvolcore.grounder import QwenVLGrounder
    from medvolcore.serve.http import HttpServer, HttpSettings
    from medvolcore.serve.worker import Worker

    asked = threading.local()
    ground, generate = QwenVLGrounder.ground, QwenVLGrounder._generate_text

    def remember(self, stack, query, **kw):
        asked.query = query
        return ground(self, stack, query, **kw)

    def answer(self, *a, **kw):
        if "cyst" in getattr(asked, "query", ""):
            return ABSENT, {"new_tokens": 12}
        return generate(self, *a, **kw)

    monkeypatch.setattr(QwenVLGrounder, "ground", remember)
    monkeypatch.setattr(QwenVLGrounder, "_generate_text", answer)
    (tmp_path / "servers.json").write_text(json.dumps({"servers": {"orthanc": {"url": f"{orthanc.url}/dicom-web"}}}))
    servers = pacs.load_servers(tmp_path / "servers.json", ["orthanc"])
    worker = Worker(default_preset="tiny", device="cpu", transport="http", threads=1, pacs_servers=servers)
    server = HttpServer(HttpSettings(port=0, monailabel="orthanc"), worker, None)
    worker.preload("tiny")
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.server_close()
    worker.close(10)


def _viewport(page) -> np.ndarray:
    from io import BytesIO

    from PIL import Image

    box = page.locator("canvas").first.bounding_box()
    png = page.screenshot(clip=box)
    return np.asarray(Image.open(BytesIO(png)).convert("RGB")).astype(int)


def test_ohif_segments_a_query_and_says_not_found(viewer_worker, tmp_path):
    from playwright.sync_api import sync_playwright

    t0 = time.monotonic()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{viewer_worker}/ohif/monai-label?StudyInstanceUIDs={STUDY}")
            page.locator("#monailabelServerURL").wait_for(timeout=60000)
            page.wait_for_function("() => document.querySelectorAll('canvas').length > 0", timeout=60000)
            page.wait_for_timeout(1500)  # the first slice drawn
            before = _viewport(page)
            assert "Research use only" in page.locator("#medvol-result").text_content()
            # the panel's server is this worker (the page set it); connect: GET /info/
            assert page.locator("#monailabelServerURL").input_value() == viewer_worker + "/"
            page.locator("#monailabelServerURL").locator("xpath=../..").locator("button").click()
            page.get_by_text("Options / Configurations").wait_for(timeout=30000)
            assert "meaningless" in page.locator(".monaiLabelPanel").text_content()  # the preset's honest name

            def run(query: str) -> str:
                page.get_by_text("Options / Configurations").click()
                page.locator("#infertinyquery").fill(query)
                page.get_by_role("button", name="Confirm").click()
                page.get_by_text("Auto-Segmentation").click()
                page.locator("button[title='Run Segmentation']").click()
                page.wait_for_function("() => /found:|not found|refused/.test("
                                       "document.getElementById('medvol-result').textContent)", timeout=240000)
                page.wait_for_timeout(1500)  # the label map drawn
                return page.locator("#medvol-result").text_content()

            said = run("liver")
            assert "found: liver" in said and "segment: liver" in said, said
            after = _viewport(page)
            page.screenshot(path=str(tmp_path / "ohif-segmented.png"))
            changed = np.abs(after - before).sum(axis=2) > 60
            tinted = changed & (after[..., 0] > after[..., 2] + 20)  # the liver segment's colour is reddish
            assert tinted.mean() > 0.02, f"no overlay drawn ({tinted.mean():.4f} of the viewport)"

            said = run("the kidney cyst")
            assert "not found in this CT: the kidney cyst" in said, said
            page.screenshot(path=str(tmp_path / "ohif-not-found.png"))
            cleared = _viewport(page)
            assert (np.abs(cleared - before).sum(axis=2) > 60).mean() < tinted.mean() / 4  # the overlay is gone
        finally:
            browser.close()
    print(f"browser test: {time.monotonic() - t0:.1f} s; screenshots in {tmp_path}")

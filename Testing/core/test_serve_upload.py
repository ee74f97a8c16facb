"""A volume uploaded as an HTTP body (medvolcore.serve.upload): its NIfTI header read from the first
bytes, the bounds it sets, the body streamed to a private file; then the HTTP worker's probes of the
same (issue 26 item 6), on an in-process server whose job reads the uploaded volume as a real one does.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import socket
import time

import nibabel as nib
import numpy as np
import pytest

from medvolcore.errors import LimitError, VolumeError
from medvolcore.serve import upload
from medvolcore.serve.upload import HeaderInfo, body_bound, read_header, store_body, upload_ceiling
from medvolcore.volume import MAX_NIFTI_EXTENSIONS

from core.test_serve_http import SMALL_ANCHOR, _InProcess, _volume_rpc

MB = 1 << 20


def _nii(shape=(10, 12, 7), dtype=np.int16) -> bytes:
    return nib.Nifti1Image(np.zeros(shape, dtype), np.eye(4)).to_bytes()


# ---- the header and the bounds it sets ------------------------------------------------------------

def test_the_ceiling_is_eight_bytes_a_voxel_plus_the_largest_header_region():
    assert upload_ceiling(None) is None
    assert upload_ceiling(1000) == 1000 * 8 + MAX_NIFTI_EXTENSIONS + 544 + MB
    assert upload_ceiling(2000) - upload_ceiling(1000) == 8000  # float64 / int64: the widest voxel read


@pytest.mark.parametrize("gz", [False, True], ids=["nii", "nii.gz"])
def test_the_header_gives_shape_voxel_size_offset_and_the_body_bound(gz):
    raw = _nii((10, 12, 7), np.int16)
    body = gzip.compress(raw) if gz else raw
    info = read_header(body, True, None)
    assert (info.shape, info.voxel_bytes, info.offset, info.gzip) == ((10, 12, 7), 2, 352, gz)
    assert info.raw_bytes == 352 + 10 * 12 * 7 * 2 == len(raw)  # the uncompressed file, to the byte
    # the body may be its uncompressed size, + 1 % for gzip's blocks, + 1 MB for a gzip member's header
    assert body_bound(info) == len(raw) + (len(raw) // 100 if gz else 0) + MB


def test_a_nifti_2_header_counts_every_dimension_and_component():
    body = nib.Nifti2Image(np.zeros((3, 4, 5, 2), np.float64), np.eye(4)).to_bytes()
    info = read_header(body, True, None)
    assert (info.shape, info.voxel_bytes, info.offset) == ((3, 4, 5, 2), 8, 544)
    assert info.raw_bytes == 544 + 3 * 4 * 5 * 2 * 8 == len(body)
    with pytest.raises(LimitError, match="3×4×5×2 = 120 voxels, over the limit of 119"):
        read_header(body, True, 119)


def test_a_header_over_the_voxel_limit_is_refused_from_the_first_bytes_of_a_gzip_bomb():
    hdr = nib.Nifti1Header()
    hdr.set_data_shape((2048, 2048, 1000))
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = 352
    stream = gzip.compress(hdr.binaryblock + b"\0" * 4 + b"\0" * (8 * MB))  # 8 MB of the declared 8 GB
    with pytest.raises(LimitError, match=r"2048×2048×1000 = 4,194,304,000 voxels, over the limit of 1,000,000"):
        read_header(stream[:4096], False, 1_000_000)  # decided on 4 kB: the rest is never needed
    assert read_header(stream[:4096], False, None).shape == (2048, 2048, 1000)


def test_too_few_bytes_wait_for_more_unless_the_body_is_complete():
    raw = _nii()
    assert read_header(raw[:100], False, None) is None  # more bytes may come
    with pytest.raises(VolumeError, match=r"not NIfTI \(\.nii or \.nii\.gz\)"):
        read_header(raw[:100], True, None)  # the whole body is 100 bytes: not NIfTI
    with pytest.raises(VolumeError, match="not a readable gzip stream"):
        read_header(b"\x1f\x8b" + b"junk" * 100, True, None)
    with pytest.raises(VolumeError, match="not NIfTI"):
        read_header(b"P5 not a volume" * 100, True, None)


# ---- the body streamed to a private file ------------------------------------------------------------

class _Client(io.BytesIO):
    """A connection's body: records each read's size; holds more bytes than the request declared."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.asked = []

    def read(self, n=-1):
        self.asked.append(n)
        return super().read(n)


def test_the_body_is_read_in_chunks_up_to_its_length_and_no_further(tmp_path):
    rng = np.random.default_rng(1)
    body = rng.integers(0, 256, size=2 * MB + 123, dtype=np.uint8).tobytes()
    prefix, n = body[:1000], len(body)
    client = _Client(body[1000:] + b"the next request's bytes")
    info = HeaderInfo((1,), 1, 352, gzip=True)
    up = store_body(prefix, client.read, n, info, tmp_path)
    assert client.tell() == n - 1000  # the bytes after the body are left unread
    assert all(0 < k <= upload.CHUNK for k in client.asked) and sum(client.asked) == n - 1000
    assert up.size == n and up.path.read_bytes() == body and up.sha256 == hashlib.sha256(body).hexdigest()
    assert up.path.parent == tmp_path and up.path.name.startswith("upload-") and up.path.name.endswith(".nii.gz")
    assert up.info is info
    up.remove()
    up.remove()  # a second remove is harmless
    assert list(tmp_path.iterdir()) == []


def test_a_client_that_stops_early_leaves_no_file(tmp_path):
    client = _Client(b"x" * 5000)
    assert store_body(b"y" * 100, client.read, 10_000, HeaderInfo((1,), 1, 352, gzip=False), tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_an_upload_that_would_fill_the_disk_is_refused(tmp_path, monkeypatch):
    free = 100 * MB

    class Usage:
        def __init__(self, *a):
            self.free = free

    monkeypatch.setattr(upload.shutil, "disk_usage", Usage)
    upload.check_space(tmp_path, free - 64 * MB)  # leaves the 64 MB margin: accepted
    with pytest.raises(LimitError, match="no space left for the uploaded volume"):
        upload.check_space(tmp_path, free - 64 * MB + 1)


# ---- through the HTTP worker ------------------------------------------------------------------------

def _nifti_bytes(shape, dtype, gz: bool, fill=None) -> bytes:
    """A NIfTI file's bytes (``.nii.gz`` when ``gz``) holding ``shape`` voxels of ``dtype``."""
    import gzip as _gzip

    import nibabel as nib
    import numpy as np

    arr = np.zeros(shape, dtype) if fill is None else fill.astype(dtype)
    raw = nib.Nifti1Image(arr, np.diag([0.8, 0.8, 2.5, 1.0])).to_bytes()
    return _gzip.compress(raw, 1) if gz else raw


class _Reading(_InProcess):
    """An in-process server whose stand-in job reads the uploaded volume as a real job does (the
    worker's own reader and cache, no model) and says what it read and which uploads exist."""

    def _execute(self, job):
        stack, digest, _ = self.worker._read_stack(job, lambda *a: None)
        return {"shape": list(stack.volume.shape), "sha256": digest, "sum": float(stack.volume.array.sum()),
                "uploads": sorted(p.name for p in self.worker.tmp_dir.glob("upload-*"))}


@pytest.fixture(scope="module")
def reading():
    s = _Reading(max_request_bytes=1 << 20, max_voxels=1_000_000)  # request limit 1 MB, voxel limit 1 M
    yield s
    s.close()


@pytest.mark.probe("26.6", "volume bodies over --max-request-mb are streamed to a private file, bounded by --max-voxels")
@pytest.mark.parametrize("gz", [False, True], ids=["nii", "nii.gz"])
def test_volume_body_over_the_request_limit_is_read_from_a_private_file(reading, gz, record_property):
    import hashlib

    import numpy as np

    rng = np.random.default_rng(0)
    fill = rng.integers(-1000, 1000, size=(100, 100, 90))  # 900 k voxels: under the voxel limit
    body = _nifti_bytes((100, 100, 90), np.float32, gz, fill)  # 3.6 MB raw: over the 1 MB request limit
    assert len(body) > 1 << 20
    record_property("body MB", round(len(body) / 2 ** 20, 2))
    resp, data = _volume_rpc(reading.port, body, {"id": "big", "op": "propagate", "anchor": SMALL_ANCHOR})
    r = json.loads(data)
    assert resp.status == 200 and r["ok"] is True, r
    res = r["result"]
    assert res["shape"] == [100, 100, 90]  # every voxel arrived
    assert res["sum"] == pytest.approx(float(fill.sum()))
    assert res["sha256"] == hashlib.sha256(body).hexdigest()  # the cache key is the body's content hash
    assert len(res["uploads"]) == 1 and res["uploads"][0].endswith(".nii.gz" if gz else ".nii")  # on disk while read
    assert not list(reading.worker.tmp_dir.glob("upload-*"))  # removed with the reply
    # a JSON body keeps the small request limit
    conn = reading.connect()
    conn.request("POST", "/rpc", body=b'{"id": 1, "op": "hello", "pad": "' + b"x" * (2 << 20) + b'"}',
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "too_large"
    conn.close()


@pytest.mark.probe("26.6", "volume over --max-voxels (raw and gzip bomb): refused from its header, the rest unsent")
@pytest.mark.parametrize("gz", [False, True], ids=["nii", "gzip-bomb"])
def test_volume_over_the_voxel_limit_is_refused_from_its_first_bytes(reading, gz):
    import numpy as np

    from core.probes import bomb

    declared = 16_000_000  # under the byte ceiling of 1 M voxels (17.4 MB), so the header decides
    first = bomb((512, 512, 40))[:1 << 16]
    if not gz:  # the same header, declaring 512×512×40
        import nibabel as nib

        hdr = nib.Nifti1Header()
        hdr.set_data_shape((512, 512, 40))
        hdr.set_data_dtype(np.int16)
        hdr["vox_offset"] = 352
        first = hdr.binaryblock + b"\0" * 4 + b"\0" * ((1 << 16) - 352)
    s = socket.create_connection(("127.0.0.1", reading.port), timeout=10)
    t = time.perf_counter()
    s.sendall(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
              b'X-MedVol-Request: {"id": "b", "op": "propagate", "anchor": {}}\r\n'
              + f"Content-Length: {declared}\r\n\r\n".encode() + first)  # the other 15.9 MB are never sent
    got = b""
    while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    s.close()
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    r = json.loads(got.split(b"\r\n\r\n", 1)[1])
    assert r["error"]["code"] == "too_large" and "512×512×40 = 10,485,760 voxels" in r["error"]["message"]
    assert "--max-voxels" in r["error"]["message"] and time.perf_counter() - t < 3
    assert not list(reading.worker.tmp_dir.glob("upload-*"))


@pytest.mark.probe("26.6", "volume bodies: over the ceiling, longer than the header needs, not NIfTI, no request")
def test_volume_body_bounds_from_the_header(reading):
    import numpy as np

    # Content-Length over max_voxels × 8 bytes (+ header room): refused before a byte is read
    replies = reading.raw(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                          b'X-MedVol-Request: {"id": 1, "op": "propagate", "anchor": {}}\r\n'
                          b"Content-Length: 100000000\r\n\r\n", wait=5)
    assert replies[0][0] == 413 and "--max-voxels 1,000,000" in replies[0][1]["error"]["message"], replies
    assert replies[-1] != "open"
    # a 10×10×10 header with 3 MB of body: more than its voxels need
    small = _nifti_bytes((10, 10, 10), np.int16, False)
    resp, data = _volume_rpc(reading.port, small + b"\0" * (3 << 20), {"id": 2, "op": "propagate", "anchor": {}})
    assert resp.status == 413 and "header declares need" in json.loads(data)["error"]["message"]
    # not NIfTI; no request object
    resp, data = _volume_rpc(reading.port, b"P5 not a volume" * 100, {"id": 3, "op": "propagate", "anchor": {}})
    assert resp.status == 400 and json.loads(data)["error"]["code"] == "bad_volume"
    conn = reading.connect()
    conn.request("POST", "/rpc", body=small, headers={"Content-Type": "application/octet-stream"})
    resp = conn.getresponse()
    assert resp.status == 400 and "X-MedVol-Request" in json.loads(resp.read())["error"]["message"]
    conn.close()
    assert not list(reading.worker.tmp_dir.glob("upload-*"))

"""DICOMweb locations in ``medvol segment``: ``--volume`` a series URL, ``--out`` a study URL.

:func:`dicomweb_run` turns the command's URLs into local paths for the job and back: the series is
retrieved (:func:`medvolcore.pacs.retrieve_series`) into a private temporary folder (or under
``--keep-downloads DIR``) before any model loads; a study URL in ``--out`` becomes a DICOM-SEG
written locally (beside the other outputs' set, checked like them), stored once the job's outputs
have all been committed. The temporary folder, downloads and local SEG included, is removed when
the command ends, whatever the outcome.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..errors import InputError


def add_dicomweb_options(sp) -> None:
    g = sp.add_argument_group("DICOMweb (a PACS): --volume …/studies/S/series/SE, --out …/studies/S")
    g.add_argument("--dicomweb-token-file", metavar="FILE",
                   help="file holding the server's bearer token (or a whole 'Basic …'/'Bearer …' Authorization "
                        "value); sent over HTTPS, or plain HTTP to this machine's loopback only")
    g.add_argument("--keep-downloads", metavar="DIR",
                   help="keep the retrieved series under DIR/SERIES_UID (default: deleted when the command ends); "
                        "a retrieval into a folder already there fetches only the instances missing")
    g.add_argument("--dicomweb-max-instances", type=int, default=2000, metavar="N",
                   help="refuse a series of more instances (default 2000)")
    g.add_argument("--dicomweb-max-instance-mb", type=float, default=512, metavar="MB",
                   help="refuse an instance larger than this (default 512)")
    g.add_argument("--dicomweb-max-mb", type=float, default=8192, metavar="MB",
                   help="refuse a series larger than this in all (default 8192)")
    g.add_argument("--dicomweb-timeout", type=float, default=900, metavar="S",
                   help="give up a retrieval after this many seconds (default 900)")


def _limits(args):
    from ..pacs import Limits

    values = (args.dicomweb_max_instances, args.dicomweb_max_instance_mb, args.dicomweb_max_mb, args.dicomweb_timeout)
    if any(v is None or v <= 0 for v in values):
        raise InputError("--dicomweb-max-instances, --dicomweb-max-instance-mb, --dicomweb-max-mb and "
                         "--dicomweb-timeout must be positive")
    return Limits(max_instances=int(values[0]), max_instance_bytes=int(values[1] * 2**20),
                  max_bytes=int(values[2] * 2**20), timeout_s=float(values[3]))


@contextmanager
def dicomweb_run(args, outs: list):
    """``(volume, outs, finish)``: the local volume and outputs for the job, and ``finish(res)``
    that stores the SEG after the job and adds ``retrieved``/``stored`` to the result."""
    from .. import pacs

    source = pacs.parse_url(args.volume, "--volume") if pacs.is_dicomweb(args.volume) else None
    dests = [pacs.parse_url(o, "--out", series=False) for o in outs if pacs.is_dicomweb(o)]
    local = [o for o in outs if not pacs.is_dicomweb(o)]
    if len(dests) > 1:
        raise InputError("--out: give one DICOMweb study to store into")
    if source is None and not dests:
        if args.dicomweb_token_file or args.keep_downloads:
            raise InputError("--dicomweb-token-file and --keep-downloads go with a DICOMweb --volume or --out")
        yield args.volume, outs, lambda res: res
        return
    if dests and source is not None and dests[0].study != source.study:
        raise InputError(f"--out {dests[0]}: the series belongs to study {source.study}; a DICOM-SEG is stored into "
                         "its source's study")
    if args.keep_downloads and source is None:
        raise InputError("--keep-downloads goes with a DICOMweb --volume")
    token = pacs.read_token(args.dicomweb_token_file) if args.dicomweb_token_file else None
    limits = _limits(args)
    work = Path(tempfile.mkdtemp(prefix="medvol-dicomweb-"))  # private (0700): patient data
    try:
        volume, retrieved = args.volume, None
        if source is not None:
            folder = (Path(args.keep_downloads) / source.series) if args.keep_downloads else work / "series"
            retrieved = pacs.retrieve_series(source, folder, token, limits)
            if not args.no_progress:
                mb = retrieved["bytes"] / 2**20
                sys.stderr.write(f"retrieved {retrieved['instances']} instances ({mb:.1f} MB) from "
                                 f"{source.host} in {retrieved['seconds']:.1f} s\n")
            volume = str(folder)
        seg = None
        if dests:
            seg = next((o for o in local if str(o).lower().endswith(".dcm")), None) or str(work / "seg.dcm")
            local = local + [seg] if seg not in local else local

        def finish(res):
            if retrieved is not None:
                retrieved["mb_per_s"] = round(retrieved["bytes"] / 2**20 / max(retrieved["seconds"], 1e-6), 2)
                res["retrieved"] = retrieved
                if args.keep_downloads:
                    res["downloads"] = str(Path(args.keep_downloads) / source.series)
            if dests:
                if not Path(seg).is_file():
                    notes = "; ".join(res.get("notes") or []) if isinstance(res, dict) else ""
                    raise pacs.PacsError("no DICOM-SEG was written, so nothing was stored" + (f" ({notes})" if notes
                                                                                             else ""))
                res["stored"] = pacs.store_seg(Path(seg), dests[0], token)
            return res

        yield volume, local, finish
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stored_text(res: dict) -> str:
    lines = []
    r = res.get("retrieved")
    if r:
        lines.append(f"retrieved {r['instances']} instances ({r['bytes'] / 2**20:.1f} MB, {r['mb_per_s']} MB/s) "
                     f"from {r['url']}")
    s = res.get("stored")
    if s:
        lines.append(f"stored the DICOM-SEG {s['sop_instance_uid']} into {s['url']}")
    return "\n".join(lines)

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


def add_dicomweb_options(sp, batch: bool = False) -> None:
    g = sp.add_argument_group("DICOMweb (a PACS): a manifest's volume …/studies/S/series/SE" if batch else
                              "DICOMweb (a PACS): --volume …/studies/S/series/SE, --out …/studies/S")
    g.add_argument("--dicomweb-token-file", metavar="FILE",
                   help="file holding the server's bearer token (or a whole 'Basic …'/'Bearer …' Authorization "
                        "value); sent over HTTPS, or plain HTTP to this machine's loopback only"
                        + ("; every series URL of the manifest must then be on one server" if batch else ""))
    g.add_argument("--keep-downloads", metavar="DIR",
                   help="keep the retrieved series under DIR/SERIES_UID (default: deleted when "
                        + ("each case ends" if batch else "the command ends")
                        + "); a retrieval into a folder already there fetches only the instances missing")
    if batch:
        g.add_argument("--pacs-config", metavar="FILE",
                       help="servers file (JSON, as for medvol serve): with --allow-pacs, series URLs are read only "
                            "from the servers allowed, each with its token_file and limits")
        g.add_argument("--allow-pacs", action="append", metavar="NAME",
                       help="read series URLs from server NAME of --pacs-config (repeatable)")
        g.add_argument("--store-seg", action="store_true",
                       help="store each URL case's DICOM-SEG into its series' study on the same server (STOW-RS), "
                            "before the case counts as finished; the local copy is not kept")
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


def series_access(args):
    """``medvol batch``'s DICOMweb options as a :class:`medvolcore.pacs.SeriesAccess` (files read,
    nothing contacted)."""
    from .. import pacs

    if bool(args.pacs_config) != bool(args.allow_pacs):
        raise InputError("--allow-pacs NAME and --pacs-config FILE go together (the file says where NAME is)")
    if args.pacs_config and args.dicomweb_token_file:
        raise InputError("with --pacs-config each server's token is its token_file; leave out --dicomweb-token-file")
    servers = pacs.load_servers(args.pacs_config, args.allow_pacs) if args.pacs_config else None
    token = pacs.read_token(args.dicomweb_token_file) if args.dicomweb_token_file else None
    return pacs.SeriesAccess(token=token, limits=_limits(args), servers=servers,
                             keep=Path(args.keep_downloads) if args.keep_downloads else None)


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
    if args.dicomweb_token_file and dests and source is not None and dests[0].base != source.base:
        raise InputError(f"--dicomweb-token-file is sent to one server, but --volume is on {source.host} and --out "
                         f"on {dests[0].host}: store into the server the series came from, or write the SEG to a "
                         "file and store it with that server's own credentials")
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
                if Path(seg).parent == work:  # the local copy is deleted when the command ends: not said as written
                    res["outs"] = [o for o in res.get("outs") or [] if o != str(seg)]
                    if res.get("out") == str(seg):
                        res["out"] = res["outs"][0] if res["outs"] else None
            return res

        yield volume, local, finish
    finally:
        shutil.rmtree(work, ignore_errors=True)


FIND_HELP = "Search a DICOMweb server for series (QIDO-RS) and write a medvol batch manifest of their URLs."


def add_pacs_command(sub, add):
    """``medvol pacs find``."""
    sp = add("pacs", FIND_HELP, cmd_pacs)
    sp.add_argument("action", choices=["find"], help="find: search for series and write a manifest")
    sp.add_argument("--url", required=True, metavar="BASE",
                    help="the server's DICOMweb root: dicomweb://HOST[:PORT]/PATH (Orthanc: …/dicom-web) or https://…")
    sp.add_argument("--modality", metavar="M", help="only series of this modality (CT, MR, …)")
    sp.add_argument("--study-date", metavar="RANGE", help="YYYYMMDD, YYYYMMDD-YYYYMMDD, -YYYYMMDD or YYYYMMDD-")
    sp.add_argument("--limit", type=int, default=1000, metavar="N", help="at most N series (default 1000)")
    sp.add_argument("--query", required=True, help="the query of every row (what to segment in each series)")
    sp.add_argument("--out", required=True, metavar="MANIFEST.csv", help="the manifest to write (id,volume,query)")
    sp.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    sp.add_argument("--dicomweb-token-file", metavar="FILE", help="as for medvol segment")
    sp.add_argument("--dicomweb-timeout", type=float, default=60, metavar="S", help="give up after S seconds (60)")
    return sp


def cmd_pacs(args) -> int:
    import csv
    import io
    import json

    from .. import pacs
    from ..fileio import atomic_path
    from ..grounder import validate_query

    out = Path(args.out)
    if not out.name.lower().endswith(".csv"):
        raise InputError(f"--out {out}: write the manifest as a .csv file")
    if out.exists() and not args.overwrite:
        raise InputError(f"--out {out} exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise InputError(f"--out {out}: the folder {out.parent} does not exist")
    query = validate_query(args.query)
    if not args.dicomweb_timeout or args.dicomweb_timeout <= 0:
        raise InputError("--dicomweb-timeout must be positive")
    token = pacs.read_token(args.dicomweb_token_file) if args.dicomweb_token_file else None
    found = pacs.find_series(args.url, args.modality, args.study_date, args.limit, token, args.dicomweb_timeout)
    text = io.StringIO(newline="")
    w = csv.writer(text, lineterminator="\n")
    w.writerow(["id", "volume", "query"])
    for url in found:
        w.writerow([url.series, str(url).replace("http://", "dicomweb://", 1), query])
    with atomic_path(out, overwrite=args.overwrite) as tmp:
        Path(tmp).write_text(text.getvalue(), encoding="utf-8")
    if args.json:
        sys.stdout.write(json.dumps({"manifest": str(out), "series": len(found),
                                     "urls": [str(u) for u in found]}, indent=2) + "\n")
    else:
        sys.stdout.write(f"{len(found)} series written to {out}\n")
    return 0


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

"""``medvol serve``: its options, checked, turned into the worker's and the transport's settings.

The worker and its transports are :mod:`medvolcore.serve`; the protocol is ``docs/protocol.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cpu import threads_arg
from ..errors import InputError
from ..serve.cache import DEFAULT_CACHE_SIZE, DEFAULT_FEATURE_CACHE_MB, DEFAULT_MAX_VOXELS
from ..serve.http import (DEFAULT_CLIENT_TIMEOUT_S, DEFAULT_HOST, DEFAULT_MAX_CONNECTIONS, DEFAULT_PORT,
                          DEFAULT_SESSION_IDLE_S, HttpSettings, check_folders, serve_http)
from ..serve.lifecycle import setup_logging
from ..serve.protocol import DEFAULT_MAX_REQUEST_MB
from ..serve.stdio import serve_stdio
from ..serve.worker import WorkerSettings


def cmd_serve(args) -> int:
    if args.max_request_mb <= 0:
        raise InputError(f"--max-request-mb must be positive, got {args.max_request_mb:g}")
    if args.max_voxels < 1:
        raise InputError(f"--max-voxels must be positive, got {args.max_voxels}")
    http_only = (args.token_file or args.port is not None or args.host is not None or args.data_dir is not None
                 or args.out_dir is not None or args.allowed_host or args.max_connections is not None
                 or args.client_timeout is not None or args.session_idle_s is not None or args.tls_cert is not None
                 or args.tls_key is not None or args.monailabel is not None or args.ohif_dir is not None)
    if not args.http and http_only:
        raise InputError("--host, --port, --token-file, --data-dir, --out-dir, --allowed-host, --max-connections, "
                         "--client-timeout, --session-idle-s, --tls-cert, --tls-key, --monailabel and --ohif-dir apply to --http "
                         "only")
    http = None
    if args.http:
        http = HttpSettings(host=args.host or DEFAULT_HOST, port=DEFAULT_PORT if args.port is None else args.port,
                            token_file=args.token_file, allowed_hosts=tuple(args.allowed_host or ()),
                            max_connections=DEFAULT_MAX_CONNECTIONS if args.max_connections is None
                            else args.max_connections,
                            client_timeout=DEFAULT_CLIENT_TIMEOUT_S if args.client_timeout is None
                            else args.client_timeout,
                            session_idle_s=DEFAULT_SESSION_IDLE_S if args.session_idle_s is None
                            else args.session_idle_s, tls_cert=args.tls_cert, tls_key=args.tls_key,
                            monailabel=args.monailabel, ohif_dir=args.ohif_dir,
                            behind_front=bool(getattr(args, "behind_front", False)))
        if http.behind_front and not (args.token_file and http.host == "127.0.0.1"):
            raise InputError("--behind-front is for the workers of --devices (127.0.0.1, the front's token file)")
        if http.max_connections < 1:
            raise InputError(f"--max-connections must be at least 1, got {http.max_connections}")
        if not http.client_timeout > 0:
            raise InputError(f"--client-timeout must be positive, got {http.client_timeout:g}")
        if not http.session_idle_s > 0:
            raise InputError(f"--session-idle-s must be positive, got {http.session_idle_s:g}")
    if args.monailabel is not None and args.monailabel not in (args.allow_pacs or ()):
        raise InputError(f"--monailabel {args.monailabel}: name a server of --allow-pacs (the series MONAI Label's "
                         "clients name by UID are looked up there)")
    if args.ohif_dir is not None and args.monailabel is None:
        raise InputError("--ohif-dir goes with --monailabel NAME (the viewer is served with MONAI Label's routes)")
    if args.ohif_dir is not None and not (Path(args.ohif_dir) / "index.html").is_file():
        raise InputError(f"--ohif-dir {args.ohif_dir}: no index.html there (the viewer's folder)")
    devices = None
    if args.devices is not None:
        if args.monailabel is not None:
            raise InputError("--monailabel serves one worker; it does not go with --devices")
        if not args.http:
            raise InputError("--devices applies to --http only (Slicer's local worker runs on one device)")
        if args.device is not None:
            raise InputError("give --device (one worker) or --devices (one worker per device), not both")
        from ..serve.devices import parse_devices

        devices = parse_devices(args.devices)
    threads = args.threads  # None: medvolcore.cpu's rule, decided when the first job arrives
    if not args.feature_cache_mb >= 0:
        raise InputError(f"--feature-cache-mb must be 0 or more, got {args.feature_cache_mb:g}")
    if args.preset is not None:
        from ..models import check_adapter_given

        check_adapter_given(args.preset, args.adapter)  # medvol-r1 without --adapter: one line, exit 2
    if bool(args.pacs_config) != bool(args.allow_pacs):
        raise InputError("--allow-pacs NAME and --pacs-config FILE go together (the file says where NAME is)")
    pacs_servers = None
    if args.allow_pacs:
        from ..pacs import load_servers

        pacs_servers = load_servers(args.pacs_config, args.allow_pacs)
    settings = WorkerSettings(preset=args.preset, adapter=args.adapter, device=args.device or "auto",
                              cache_size=args.cache_size,
                              max_request_mb=args.max_request_mb, threads=threads, max_voxels=args.max_voxels,
                              data_dir=args.data_dir, out_dir=args.out_dir, debug=bool(getattr(args, "debug", False)),
                              feature_cache_mb=args.feature_cache_mb, pacs_servers=pacs_servers)
    if http is not None:
        if not 0 <= http.port <= 65535:
            raise InputError(f"--port must be 0..65535, got {http.port}")
        check_folders(settings)  # before anything starts: one line and exit 2 when they overlap
    setup_logging(bool(getattr(args, "debug", False)))
    if devices is not None:
        from ..serve.router import serve_devices, worker_arguments

        return serve_devices(settings, http, devices, worker_arguments(args))
    if http is not None:
        return serve_http(settings, http)
    return serve_stdio(settings)


def _add_arguments(sp) -> None:
    mode = sp.add_mutually_exclusive_group(required=True)
    mode.add_argument("--stdio", action="store_true", help="JSON lines on stdin/stdout (how Slicer runs it)")
    mode.add_argument("--http", action="store_true", help="HTTP: POST /rpc with one JSON request, GET /status")
    sp.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1; others need --token-file)")
    sp.add_argument("--port", type=int, default=None, help="port (default 8765; 0 picks a free one, shown in the ready line)")
    sp.add_argument("--token-file", metavar="FILE", help="file holding the bearer token every HTTP request must carry")
    sp.add_argument("--preset", default=None, help="model preset to load at start and use by default (default: load "
                                                   "the default preset on the first request)")
    sp.add_argument("--adapter", metavar="PATH", help="LoRA adapter folder for --preset")
    sp.add_argument("--device", choices=["cpu", "cuda", "auto"], default=None, help="cpu, cuda or auto (default)")
    sp.add_argument("--devices", metavar="LIST", default=None,
                    help="HTTP only: one worker per device behind this one address, e.g. cuda:0,cuda:1 (or cpu,cpu); "
                         "requests about one volume go to the worker that holds it, another answers when it is "
                         "gone (docs/deploy.md)")
    sp.add_argument("--max-request-mb", type=float, default=DEFAULT_MAX_REQUEST_MB,
                    help=f"largest request line / JSON body in MB (default {DEFAULT_MAX_REQUEST_MB}); a volume sent "
                         "as the HTTP body is bounded by --max-voxels instead")
    sp.add_argument("--threads", type=threads_arg, default=None, metavar="N|auto",
                    help="CPU threads for the models (default auto, decided at the first job: the physical cores "
                         "this process may use, less those other work keeps busy, less one left to Slicer when "
                         "there are more than two; OMP_NUM_THREADS when set)")
    sp.add_argument("--cache-size", type=int, default=DEFAULT_CACHE_SIZE,
                    help=f"volumes kept in memory, by content hash (default {DEFAULT_CACHE_SIZE})")
    sp.add_argument("--feature-cache-mb", type=float, default=DEFAULT_FEATURE_CACHE_MB, metavar="MB",
                    help="memory for MedSAM2's encoded slices of recent volumes, so a re-propagation with "
                         f"corrections encodes no slice again (default {DEFAULT_FEATURE_CACHE_MB}: about 480 "
                         "slices at 512 px; 0 keeps none)")
    sp.add_argument("--max-voxels", type=int, default=DEFAULT_MAX_VOXELS, metavar="N",
                    help="largest volume accepted, checked in its header before reading it (default "
                         f"{DEFAULT_MAX_VOXELS:,}: a 1024×1024 CT of 1000 slices, which a one-target request "
                         "reads and segments in about 7.3 GiB; several targets or a consensus get a "
                         "proportionally smaller volume)")
    sp.add_argument("--data-dir", metavar="DIR", default=None,
                    help="HTTP only: the one folder whose files clients may name as 'volume' (paths relative to "
                         "it; a path that leaves it or passes through a symbolic link is refused); default: no "
                         "server paths at all")
    sp.add_argument("--out-dir", metavar="DIR", default=None,
                    help="HTTP only: the one folder clients may write masks to ('out', relative to it; no "
                         "symbolic link out of it is followed); it may not overlap --data-dir; default: none, "
                         "the mask comes back in the reply")
    sp.add_argument("--pacs-config", metavar="FILE",
                    help='the DICOMweb servers the worker may know: JSON {"servers": {"NAME": {"url": '
                         '"https://host/dicom-web", "token_file": "…"}}} (docs/pacs.md)')
    sp.add_argument("--allow-pacs", action="append", metavar="NAME",
                    help="let requests name a series on server NAME of --pacs-config as 'volume' "
                         "(dicomweb://…/studies/S/series/SE); repeatable; no other URL is ever fetched")
    sp.add_argument("--monailabel", metavar="NAME", default=None,
                    help="HTTP only: also answer MONAI Label's REST contract (GET /info/, POST /infer/MODEL?image="
                         "SERIES_UID) for series of the --allow-pacs server NAME, and serve the OHIF viewer at /ohif/ "
                         "(docs/web.md)")
    sp.add_argument("--ohif-dir", metavar="DIR", default=None,
                    help="with --monailabel: the prebuilt OHIF viewer's folder (default: where bootstrap.py put it, "
                         "or $MEDVOL_OHIF_DIR)")
    sp.add_argument("--allowed-host", action="append", metavar="NAME",
                    help="HTTP only: another name clients may use in the Host header (e.g. the machine's DNS name "
                         "behind a proxy); repeatable")
    sp.add_argument("--max-connections", type=int, default=None, metavar="N",
                    help=f"HTTP only: connections served at once; more get 503 (default {DEFAULT_MAX_CONNECTIONS})")
    sp.add_argument("--client-timeout", type=float, default=None, metavar="S",
                    help="HTTP only: seconds a client has to send a request's line and headers before it is "
                         f"disconnected (default {DEFAULT_CLIENT_TIMEOUT_S:g}); a body must then keep arriving at "
                         "256 kB/s or more, else it is cut")
    sp.add_argument("--session-idle-s", type=float, default=None, metavar="S",
                    help="HTTP only: a session without a request for S seconds is forgotten and its queued "
                         f"requests are cancelled; a running one finishes (default {DEFAULT_SESSION_IDLE_S:g})")
    sp.add_argument("--tls-cert", metavar="PEM", default=None,
                    help="HTTP only: serve HTTPS with this certificate (chain) file; needs --tls-key")
    sp.add_argument("--tls-key", metavar="PEM", default=None, help="HTTP only: the private key of --tls-cert")
    # a worker of --devices: its one token is the front's private one, and X-MedVol-Client (set by
    # the front alone) names the client its sessions are counted under
    sp.add_argument("--behind-front", action="store_true", help=argparse.SUPPRESS)


SERVE_HELP = "Run a persistent worker that keeps the models loaded (protocol 1 over --stdio or --http)."


def add_serve_command(sub, add):
    """Register ``medvol serve`` with the main parser (``add`` as in :func:`medvolcore.cli.app.build_parser`)."""
    sp = add("serve", SERVE_HELP, cmd_serve)
    _add_arguments(sp)
    return sp

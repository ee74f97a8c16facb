"""``medvol mcp``: the engine as Model Context Protocol tools for agents (``docs/mcp.md``).

Its options are checked here (one line and exit 2 for a bad one, before any model loads) and
turned into :class:`medvolcore.agents.AgentSettings`; the server is :mod:`medvolcore.agents`.
Over stdio (the default, as agent hosts start it) stdout carries only JSON-RPC.
"""

from __future__ import annotations

from ..errors import DependencyError, InputError
from ..serve.limits import limit

MCP_HELP = ("Serve the engine to AI agents over the Model Context Protocol (stdio by default, or streamable "
            "HTTP); they read only the folders --allow names and the DICOMweb servers --allow-pacs names.")
DEFAULT_MAX_BODY_KB = int(limit("mcp_body").default) >> 10


def _host_port(text: str):
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host or not 0 <= int(port) <= 65535:
        raise InputError(f"--http {text!r}: expected HOST:PORT (e.g. 127.0.0.1:8766; port 0 picks a free one)")
    return host.strip("[]") if host.startswith("[") else host, int(port)


def cmd_mcp(args) -> int:
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise DependencyError("medvol mcp needs the MCP SDK: pip install 'medvolcore[mcp]'") from None
    from ..agents.places import check_places
    from ..serve.cache import DEFAULT_CACHE_SIZE, DEFAULT_FEATURE_CACHE_MB, DEFAULT_MAX_VOXELS
    from ..serve.http import HttpSettings
    from ..serve.lifecycle import setup_logging
    from ..serve.worker import WorkerSettings

    if not args.allow and not args.allow_pacs:
        raise InputError("give at least one --allow DIR (the folders agents may read volumes in) or --allow-pacs NAME")
    if bool(args.pacs_config) != bool(args.allow_pacs):
        raise InputError("--allow-pacs NAME and --pacs-config FILE go together (the file says where NAME is)")
    if args.http is None and (args.token_file or args.allowed_host):
        raise InputError("--token-file and --allowed-host apply to --http only")
    if args.max_body_kb is not None and args.max_body_kb <= 0:
        raise InputError(f"--max-body-kb must be positive, got {args.max_body_kb}")
    if args.preset is not None:
        from ..models import check_adapter_given

        check_adapter_given(args.preset, args.adapter)
    roots, out_dir = check_places(args.allow or (), args.out_dir)
    pacs_servers = None
    if args.allow_pacs:
        from ..pacs import load_servers

        pacs_servers = load_servers(args.pacs_config, args.allow_pacs)
    http = None
    if args.http is not None:
        host, port = _host_port(args.http)
        http = HttpSettings(host=host, port=port, token_file=args.token_file,
                            allowed_hosts=tuple(args.allowed_host or ()))
    worker = WorkerSettings(preset=args.preset, adapter=args.adapter, device=args.device or "auto",
                            cache_size=DEFAULT_CACHE_SIZE, threads=args.threads,
                            max_voxels=args.max_voxels or DEFAULT_MAX_VOXELS,
                            feature_cache_mb=DEFAULT_FEATURE_CACHE_MB if args.feature_cache_mb is None
                            else args.feature_cache_mb, pacs_servers=pacs_servers)
    if http is not None:
        from ..agents.http import serve_mcp_http
        from ..serve.http import listening_token

        listening_token(http)  # a non-loopback address without a token: one line, before any model loads
    # the server owns stderr logging from here on: only once every option was checked
    setup_logging(bool(getattr(args, "debug", False)))
    from ..agents.server import AgentServer, AgentSettings

    agent = AgentServer(AgentSettings(worker=worker, roots=roots, out_dir=out_dir), preload=http is not None)
    if http is not None:
        return serve_mcp_http(agent, http, (args.max_body_kb or DEFAULT_MAX_BODY_KB) * 1024)
    import anyio

    try:
        anyio.run(agent.mcp.run_stdio_async)
    except KeyboardInterrupt:
        pass
    finally:
        agent.close()
    return 0


def add_mcp_command(sub, add):
    """Register ``medvol mcp`` with the main parser (``add`` as in :func:`medvolcore.cli.app.build_parser`)."""
    from ..cpu import threads_arg

    sp = add("mcp", MCP_HELP, cmd_mcp)
    sp.add_argument("--allow", action="append", metavar="DIR",
                    help="a folder whose CT files and DICOM folders agents may name (repeatable; symbolic links "
                         "inside it are not followed)")
    sp.add_argument("--out-dir", metavar="DIR", default=None,
                    help="where results go, one folder per job (default: a private temporary folder removed at "
                         "exit); may not overlap an --allow folder")
    sp.add_argument("--pacs-config", metavar="FILE", help="the DICOMweb servers file (docs/pacs.md)")
    sp.add_argument("--allow-pacs", action="append", metavar="NAME",
                    help="let agents search and read series on server NAME of --pacs-config (repeatable)")
    sp.add_argument("--http", metavar="HOST:PORT", default=None,
                    help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio")
    sp.add_argument("--token-file", metavar="FILE",
                    help="HTTP: the bearer token every request must carry (required off loopback)")
    sp.add_argument("--allowed-host", action="append", metavar="NAME",
                    help="HTTP: another name clients may put in the Host header (repeatable)")
    sp.add_argument("--max-body-kb", type=int, default=None,
                    help=f"HTTP: largest request body in KiB (default {DEFAULT_MAX_BODY_KB}); more gets 413")
    sp.add_argument("--preset", default=None,
                    help="model preset (default: the manifest's default, loaded on first use)")
    sp.add_argument("--adapter", metavar="PATH", help="LoRA adapter folder for --preset")
    sp.add_argument("--device", choices=["cpu", "cuda", "auto"], default=None, help="cpu, cuda or auto (default)")
    sp.add_argument("--threads", type=threads_arg, default=None, metavar="N|auto", help="CPU threads for the models")
    sp.add_argument("--max-voxels", type=int, default=None, metavar="N",
                    help="largest volume accepted (as medvol serve)")
    sp.add_argument("--feature-cache-mb", type=float, default=None, metavar="MB",
                    help="memory for MedSAM2's encoded slices, so a repropagate encodes none again (as medvol serve)")
    return sp

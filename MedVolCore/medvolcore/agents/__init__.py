"""``medvol mcp``: the engine's tools for agents over the Model Context Protocol (the ``mcp`` extra).

:mod:`.server` (the tools on the SDK's ``MCPServer``, over the worker of ``medvol serve``),
:mod:`.places` (what an agent may name), :mod:`.results` (the tools' structured outputs),
:mod:`.http` (streamable HTTP on the worker's uvicorn stack). Importing this package imports
nothing of the SDK; its names load on first use.
"""

__all__ = ["AgentServer", "AgentSettings", "INSTRUCTIONS"]


def __getattr__(name):
    if name in __all__:
        from . import server

        return getattr(server, name)
    raise AttributeError(name)

"""Clients and launchers for engine fleets: one `EngineClient` interface over the in-process
engine, `verst serve` subprocesses and real SGLang servers."""

from verst.fleet.client import EngineError, HttpEngineClient, InProcessEngineClient
from verst.fleet.launcher import LocalEngine, launch_local_engines, launch_sglang
from verst.plugins import EngineClient

__all__ = [
    "EngineClient",
    "EngineError",
    "HttpEngineClient",
    "InProcessEngineClient",
    "LocalEngine",
    "launch_local_engines",
    "launch_sglang",
]

"""The one engine interface every front door calls (protocol.EngineClient), in process
(AsyncEngine) or across the frontend workers' link (remote.RemoteEngine).

AsyncEngine loads on first use (PEP 562): it brings the engine and torch, which a frontend
worker, serving from a RemoteEngine, never imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mha_serve.lazy import lazy_attributes
from mha_serve.serving.protocol import EXPECTED, EngineClient, Served, Timing, Unavailable

_LAZY = {"AsyncEngine": "async_engine", "Ticket": "async_engine", "lanes_for": "async_engine"}

if TYPE_CHECKING:
    from mha_serve.serving.async_engine import AsyncEngine, Ticket, lanes_for


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "EXPECTED",
    "AsyncEngine",
    "EngineClient",
    "Served",
    "Ticket",
    "Timing",
    "Unavailable",
    "lanes_for",
]

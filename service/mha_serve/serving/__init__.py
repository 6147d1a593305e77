"""The async front of the engine that every front door shares (gRPC servicers, the Ray app)."""

from mha_serve.serving.async_engine import EXPECTED, AsyncEngine, Timing, Unavailable, lanes_for

__all__ = ["EXPECTED", "AsyncEngine", "Timing", "Unavailable", "lanes_for"]

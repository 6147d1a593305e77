"""Addresses as the server writes them (gRPC's listen address, /metrics' URL, its errors)."""

from __future__ import annotations


def host_port(host: str, port: int) -> str:
    """host:port as gRPC and URLs write it: an IPv6 address in brackets ("[::1]:50051"),
    whether --host gave it with them or without."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"

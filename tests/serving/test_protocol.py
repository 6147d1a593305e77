"""Both engines a front door can serve from implement the one EngineClient (serving/protocol.py)
exactly: every member, with its signature, and coroutines where the Protocol has them. A
front door that works over one works over the other."""

from __future__ import annotations

import inspect
import typing

import pytest

from mha_serve.serving.async_engine import AsyncEngine
from mha_serve.serving.protocol import EngineClient
from mha_serve.serving.remote import RemoteEngine

MEMBERS = sorted(
    name
    for name, value in vars(EngineClient).items()
    if not name.startswith("_") and (callable(value) or isinstance(value, property))
)


def test_the_protocol_names_what_every_front_door_calls():
    assert {"attend", "create_session", "models", "max_response_bytes", "end_sequence"} <= set(
        MEMBERS
    )


def _parameters(function) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter but self: what a caller relies on."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in params]


@pytest.mark.parametrize("implementation", [AsyncEngine, RemoteEngine])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_engine_implements_each_member_as_the_protocol_says(implementation, name):
    want = vars(EngineClient)[name]
    if isinstance(want, property):  # an attribute or a property of the instance will do
        got = getattr(implementation, name, None)
        assert got is None or isinstance(got, property), f"{implementation.__name__}.{name}"
        if got is None:  # an instance attribute: set in __init__
            source = inspect.getsource(implementation.__init__)
            assert f"self.{name} =" in source, f"{implementation.__name__} lacks {name}"
        return
    got = getattr(implementation, name)
    assert _parameters(got) == _parameters(want), f"{implementation.__name__}.{name}"
    assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name


def test_the_protocol_is_a_typing_protocol():
    assert typing.Protocol in EngineClient.__mro__

"""Package attributes that load their module on first use (PEP 562): a package lists the
names whose modules import torch, so that its torch-free parts (errors, requests, configs)
import without it, as a frontend worker needs."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, names: dict[str, str], space: dict[str, Any]) -> Callable:
    """A module __getattr__ for `package`: names maps an attribute to the submodule (relative
    to package) that defines it; once loaded, it is kept in the package's namespace."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        space[name] = value
        return value

    return __getattr__

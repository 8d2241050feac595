"""How a stage package exposes its public API: the names other stages may import, loaded on first use.

Each stage package (`streamrl.queue`, `streamrl.weights`, ...) lists its API in its `__init__` with
`__all__, __getattr__ = exports(__name__, {name: module, ...})`. Other stages import those names from the package
(`from streamrl.queue import TrajectoryConsumer`), never from its modules: the modules are the stage's internals
(tests/test_layout.py checks it). The names load lazily (PEP 562) so that importing one light name does not pull a
stage's heavy dependencies (vLLM, Megatron) into a process that does not need them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, names: dict[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """`__all__` and the module `__getattr__` of `package`, whose API maps each name to the submodule defining it
    (relative to the package)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    return list(names), __getattr__

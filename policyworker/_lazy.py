"""Package faces whose names are resolved on first use (PEP 562), and the installed version of
an optional distribution (`installed_version`), read without importing it.

    __getattr__, __all__ = lazy_exports(__name__, {"ParallelContext": "pkg.parallel.context"})

A face built this way imports none of its modules until a name is asked for, so importing one
of the package's modules never runs the others through the face (no import cycle, no cost).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["installed_version", "lazy_exports"]


def lazy_exports(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """The module `__getattr__` of `package` that imports `names[name]` and returns its `name`
    (cached in the package's globals), and the sorted `__all__` of those names."""

    def resolve(name: str) -> Any:
        if name not in names:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg)
        value = getattr(importlib.import_module(names[name]), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return resolve, sorted(names)


def installed_version(*dists: str) -> str | None:
    """The installed version of the first of `dists` found, else None."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None

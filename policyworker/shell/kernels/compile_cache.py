"""Compiled functions, made once per process, with inductor's caches on a persistent disk folder.

`compiled_once` wraps `torch.compile(fn, dynamic=True)` per key: a second `torch.compile` of the
same function would add cache entries to the same code object and count towards dynamo's
recompile limit. `use_persistent_compile_cache` points inductor's caches (FX graph and
AOTAutograd, both on by default) at ``$XDG_CACHE_HOME/policyworker/torchinductor``
(``~/.cache/...``) unless the user set ``TORCHINDUCTOR_CACHE_DIR``, so a second process on the
machine reuses the first one's compiles instead of paying the start-up cost again (inductor's
own default, a folder in /tmp, does not survive a reboot).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compiled_once", "use_persistent_compile_cache"]

_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_COMPILED: dict[object, Callable[..., Any]] = {}


def use_persistent_compile_cache() -> str | None:
    """Point inductor's on-disk caches at a folder that outlives reboots unless the user chose.

    Sets ``TORCHINDUCTOR_CACHE_DIR`` to ``$XDG_CACHE_HOME/policyworker/torchinductor`` (default
    ``~/.cache/...``) when it is unset and that folder is writable (else inductor's default in
    /tmp stays). Returns the cache folder in effect (None: inductor's default).
    """
    if _CACHE_ENV not in os.environ:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "policyworker", "torchinductor")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            return None
        if not os.access(folder, os.W_OK):
            return None
        os.environ[_CACHE_ENV] = folder
    return os.environ[_CACHE_ENV]


def compiled_once(key: object, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile(fn, dynamic=True)`, created once per process under `key`."""
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=True)
    return _COMPILED[key]

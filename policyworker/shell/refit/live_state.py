"""A module's state dict as the refit walks it: ``StateReader.read(module)`` is
``module.state_dict(keep_vars=True)`` (the same keys, order and tensor objects), read straight from
the modules' parameters and persistent buffers while none customises its state dict.

A reader remembers, per module class, whether that class customises its state dict; its owner (a
refit sender, a receiver's applier) keeps one for its lifetime and passes it where a refit walks.

``ModuleTree.of(module)`` is the cheaper question a refit asks every time before reusing what it
worked out at an earlier refit: is the module tree still made of the same module objects under
the same names?
"""

from __future__ import annotations

from functools import partial
from itertools import chain
from operator import attrgetter, is_, is_not
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleTree", "StateReader", "live_state_dict"]

_STATE_METHODS = ("state_dict", "_save_to_state_dict", "get_extra_state")


class StateReader:
    """``state_dict(keep_vars=True)`` without torch's per-module overhead, for one owner."""

    def __init__(self) -> None:
        # Per class: is its state dict exactly its parameters and persistent buffers (nn.Module's
        # own ``state_dict``, ``_save_to_state_dict`` and ``get_extra_state``, none overridden)?
        self._plain_classes: dict[type, bool] = {}

    def read(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module.state_dict(keep_vars=True)``: the same keys in the same order, the same
        tensor objects. Read straight from each module's parameters and persistent buffers
        while no module in the tree customises its state dict, which takes about a third of
        torch's time; torch's own walk as soon as one does (a state-dict hook, as FSDP2
        registers, or ``state_dict``, ``_save_to_state_dict`` or ``get_extra_state``
        overridden by its class or on the instance).

        A refit walks its model's state dict once per call, before the first byte moves (on a
        GPU, while the device idles), which is why this is worth having beside torch's walk.
        """
        state: dict[str, torch.Tensor] = {}
        if self.collect_plain_state(module, "", state):
            return state
        return module.state_dict(keep_vars=True)

    def collect_plain_state(
        self, module: nn.Module, prefix: str, out: dict[str, torch.Tensor]
    ) -> bool:
        """Add ``module``'s tree to ``out`` as ``nn.Module.state_dict`` would; False (``out``
        partial) at the first module whose state dict is customised."""
        cls = type(module)
        plain = self._plain_classes.get(cls)
        if plain is None:
            plain = self._plain_classes[cls] = all(
                getattr(cls, method) is getattr(nn.Module, method) for method in _STATE_METHODS
            )
        instance = module.__dict__  # the three names spelled out: a generator here doubled the cost
        if (
            not plain
            or module._state_dict_pre_hooks
            or module._state_dict_hooks
            or "state_dict" in instance
            or "_save_to_state_dict" in instance
            or "get_extra_state" in instance
        ):
            return False
        for name, param in module._parameters.items():
            if param is not None:
                out[prefix + name] = param
        non_persistent = module._non_persistent_buffers_set
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in non_persistent:
                out[prefix + name] = buffer
        for name, child in module._modules.items():
            if child is not None and not self.collect_plain_state(child, prefix + name + ".", out):
                return False
        return True


def live_state_dict(
    module: nn.Module, reader: StateReader | None = None
) -> dict[str, torch.Tensor]:
    """``(reader or a fresh StateReader()).read(module)``: a caller that walks once keeps no
    reader; one that walks every refit passes its own."""
    return (reader if reader is not None else StateReader()).read(module)


class ModuleTree:
    """Which module objects a module tree is made of, by name: each module's submodules, level
    by level, with their counts and names.

    ``same_as`` is true exactly when no submodule was added, removed, renamed, reordered or
    replaced by another object anywhere in the tree between the two readings (objects compare
    by identity, never ``==``). Holding the objects keeps them alive, so no id or address of
    theirs can come back on a new object while a reading is kept. A fraction of a
    ``state_dict`` walk's cost: no names are joined, no hooks looked at, and every step is a
    C-level ``map`` over a whole level.
    """

    __slots__ = ("objects", "values")

    def __init__(self, values: list[Any], objects: list[Any]) -> None:
        self.values = values  # per level: each module's submodule count, then their names
        self.objects = objects  # the root, then per level every submodule (None where unset)

    @classmethod
    def of(cls, root: nn.Module) -> ModuleTree:
        """A reading of ``root``'s tree now."""
        values: list[Any] = []
        objects: list[Any] = [root]
        level: list[nn.Module] = [root]
        while level:
            dicts: list[dict[str, Any]] = [*map(_SUBMODULES, level)]
            values.append([*map(len, dicts)])  # how the names and children below split up
            parents = [*filter(None, dicts)]  # the leaves (most modules) add nothing more
            values += chain.from_iterable(parents)
            children = [*chain.from_iterable(map(dict.values, parents))]
            objects += children
            level = [*filter(_NOT_NONE, children)]
        return cls(values, objects)

    def same_as(self, other: ModuleTree) -> bool:
        """The two readings name the same objects in the same places."""
        return (
            self.values == other.values
            and len(self.objects) == len(other.objects)
            and all(map(is_, self.objects, other.objects))
        )

    def modules(self) -> list[nn.Module]:
        """Every module of the reading (a shared one as often as it is reachable)."""
        return [m for m in self.objects if m is not None]


_SUBMODULES = attrgetter("_modules")
_NOT_NONE = partial(is_not, None)

"""The imperative shell: models, process groups, transports and files, in rooms by capability.

    worker.py       PolicyWorker, the facade: the NeMo-RL method surface, one short method each
    model.py        HF load/build, attention choice, forward passes; attention.py, fusion.py,
                    lora.py (with lora_tp.py and peft_adapter.py) and optim.py are the
                    model's parts
    parallel/       ParallelContext (context), FSDP2/TP plans (plans), collectives over shards
    refit/          weights into inference engines: sender, receiver, wire format, ZMQ+IPC and
                    collective transports, SGLang, the watchdog, parameter streams (params)
    checkpoint/     HF safetensors + DCP checkpoints with an atomic commit
    engines/        adapters to inference engines
    ray/            RayWorkerGroup: PolicyWorker as a group of Ray actors (extra "ray")
    ipc_logits.py   full logits handed to a colocated consumer over CUDA IPC / shared memory

Modules that moved into a room stay importable by their old dotted path (user code and older docs
name some of them): `MOVED` maps each old path to its new one, and a finder on `sys.meta_path`
answers an import of an old path with the very module object of the new one (so monkeypatching
either name patches both).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

MOVED: dict[str, str | None] = {
    "policyworker.shell.transports": None,  # the folder is gone; its modules are listed here
    "policyworker.shell.transports.wire": "policyworker.shell.refit.wire",
    "policyworker.shell.transports.zmq_ipc": "policyworker.shell.refit.zmq_ipc",
    "policyworker.shell.transports.collective": "policyworker.shell.refit.collective",
    "policyworker.shell.transports.sglang": "policyworker.shell.refit.sglang",
    "policyworker.shell.transports.ipc_logits": "policyworker.shell.ipc_logits",
    "policyworker.shell.receiver": "policyworker.shell.refit.receiver",
    "policyworker.shell.params": "policyworker.shell.refit.params",
    "policyworker.shell.watchdog": "policyworker.shell.refit.watchdog",
    "policyworker.shell.distributed": "policyworker.shell.parallel.context",
    "policyworker.shell.collectives": "policyworker.shell.parallel.collectives",
}


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old dotted path as the module at its new path (imported once, shared); with no
    new path, as an empty package whose children are the moved modules listed in `MOVED`."""

    def __init__(self, new_name: str | None) -> None:
        self._new_name = new_name
        self._new_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if self._new_name is None:
            return None  # the import system makes a plain module from the spec
        module = importlib.import_module(self._new_name)
        self._new_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if self._new_spec is not None:
            # The import system stamped the alias spec on the shared module; give its own back.
            module.__spec__ = self._new_spec


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths in `MOVED`; refuses unknown children of a moved package."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname in MOVED:
            new_name = MOVED[fullname]
            return importlib.machinery.ModuleSpec(
                fullname, _MovedModuleLoader(new_name), is_package=new_name is None
            )
        parent = fullname.rpartition(".")[0]
        if parent in MOVED:
            msg = (
                f"No module named {fullname!r}: {parent} moved (to {MOVED[parent] or 'rooms'}) "
                f"and had no such module; see policyworker/shell/__init__.py for the rooms"
            )
            raise ModuleNotFoundError(msg, name=fullname)
        return None


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())

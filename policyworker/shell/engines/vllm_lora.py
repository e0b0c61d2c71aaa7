"""Versioned LoRA adapters in a vLLM engine: `VllmAdapterVersions`.

Each `publish()` writes the worker's adapter (alone, as a PEFT folder) and registers it with the
engine as a new ``LoRARequest`` (id = version); the base weights never move. Requests started on
version k keep k's request, new ones take `current`; a version is evicted (unloaded and its
folder removed) only when it is older than the newest `keep` and nothing `hold`s it. A version
the engine cannot load is refused at `publish()` and the previous one keeps serving.
`VllmRefit(llm, worker, lora=True)` keeps the same bookkeeping for adapters it streams in
(`adopt`), with no folder at all.
"""

from __future__ import annotations

import collections
import contextlib
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

from policyworker.errors import RefitError
from policyworker.shell.engines.vllm_support import require_vllm
from policyworker.shell.model.peft_adapter import save_peft_adapter

__all__ = ["VllmAdapterVersions"]


class VllmAdapterVersions:
    """Trainer side: `worker`'s adapter as versioned LoRA requests of `llm` (a ``vllm.LLM``
    built with ``enable_lora=True``); folders go under `root`."""

    def __init__(
        self,
        llm: Any,
        worker: Any = None,
        *,
        root: str | pathlib.Path | None = None,
        keep: int = 2,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            msg = f"keep={keep!r} must be an int >= 1 (how many recent versions stay loaded)"
            raise ValueError(msg)
        if worker is not None and (root is None or not worker.lora_module_names):
            msg = (
                "VllmAdapterVersions(llm, worker, root=...) needs a LoRA worker "
                "(policy.dtensor_cfg.lora_cfg set) and a root folder for its versions"
            )
            raise ValueError(msg)
        require_vllm()
        self.llm, self.worker, self.keep = llm, worker, keep
        self.root = pathlib.Path(root) if root is not None else None
        self.version = 0
        self._loaded: dict[int, Any] = {}  # version -> its LoRARequest
        self._owned: dict[int, pathlib.Path] = {}  # folders publish() wrote, removed on eviction
        self._holds: collections.Counter[int] = collections.Counter()

    def publish(self) -> Any:
        """Register the worker's adapter as version `version + 1`; its ``LoRARequest``.

        Raises:
            RefitError: the engine did not load it (it keeps serving the previous version).
        """
        if self.worker is None or self.root is None:
            msg = "publish() needs the worker and root given to VllmAdapterVersions"
            raise ValueError(msg)
        folder = self.root / f"v{self.version + 1}"
        cfg = self.worker.cfg
        save_peft_adapter(
            self.worker.model,
            folder,
            lora_cfg=cfg.dtensor_cfg.lora_cfg,
            base_model_name_or_path=cfg.model_name,
            write=self.worker.parallel.rank == 0,
        )
        try:
            request = self.register(folder)
        except RefitError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._owned[request.lora_int_id] = folder
        return request

    def register(self, folder: str | pathlib.Path) -> Any:
        """Register the PEFT adapter `folder` (written by anyone) as version `version + 1`.

        Raises:
            RefitError: the engine did not load it (it keeps serving the previous version).
        """
        from vllm.lora.request import LoRARequest

        version = self.version + 1
        request = LoRARequest(f"policy-v{version}", version, str(folder))
        try:
            self.llm.llm_engine.add_lora(request)
        except Exception as exc:
            msg = (
                f"vLLM did not load adapter version {version} ({type(exc).__name__}: {exc}); it "
                f"keeps serving version {self.version}"
            )
            raise RefitError(msg) from exc
        return self.adopt(request)

    def adopt(self, request: Any) -> Any:
        """Make `request` (id ``version + 1``, already registered in the engine by other means,
        e.g. an adapter-only refit) the current version; evicts as `publish()` does."""
        if request.lora_int_id != self.version + 1:
            msg = (
                f"adopt(request) takes version {self.version + 1} next, got lora_int_id="
                f"{request.lora_int_id}; versions are registered in order"
            )
            raise ValueError(msg)
        self.version = request.lora_int_id
        self._loaded[self.version] = request
        self._evict()
        return request

    @property
    def current(self) -> Any:
        """The newest version's ``LoRARequest``."""
        if not self.version:
            msg = "no adapter version was published yet; call publish() first"
            raise ValueError(msg)
        return self._loaded[self.version]

    @contextlib.contextmanager
    def hold(self) -> Iterator[Any]:
        """The current ``LoRARequest``, kept loaded until the block ends (in-flight requests)."""
        version = self.current.lora_int_id
        self._holds[version] += 1
        try:
            yield self._loaded[version]
        finally:
            self._holds[version] -= 1
            self._evict()

    @property
    def loaded_versions(self) -> list[int]:
        return sorted(self._loaded)

    def _evict(self) -> None:
        for version in sorted(self._loaded):
            if version > self.version - self.keep or self._holds[version] > 0:
                continue
            self.llm.llm_engine.remove_lora(version)
            folder = self._owned.pop(version, None)
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            del self._loaded[version]

"""Inside vLLM's worker: the rollout side of checkpoint-engine refits (``CheckpointEngineRollout``).

``CheckpointEngineVllmMixin`` is one of ``PolicyWorkerVllmExtension``'s bases, reached through
``LLM.collective_rpc``. The driver first hands every worker the trainer's
``encode_refit_info(worker.prepare_refit_info())`` (``checkpoint_engine_set_refit_info``), then
makes NeMo-RL's generation-side calls through ``checkpoint_engine_rpc(method, args)``:
``init_checkpoint_engine``, ``prepare_checkpoint_engine``,
``init_checkpoint_engine_process_group``, ``update_weights_from_checkpoint_engine``,
``finalize_checkpoint_engine``. Each refit is staged whole (atomic) and loaded through vLLM's
layerwise reload in one call (``vllm_reload.layerwise_loader``: a version vLLM cannot load
leaves the previous one serving). Every tensor-parallel rank receives whole HF tensors, which
vLLM's ``load_weights`` shards, so the collective backend serves any engine size; the ipc
backend serves one rollout rank per policy socket (``peers_per_rank``).

Imported in vLLM's worker processes only (through ``vllm_worker``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policyworker.errors import RefitError
from policyworker.shell.refit.checkpoint_engine import CheckpointEngineRollout

__all__ = ["CheckpointEngineVllmMixin"]


class CheckpointEngineVllmMixin:
    """The checkpoint-engine calls of ``PolicyWorkerVllmExtension`` (a rollout rank per worker)."""

    # Provided by the vLLM worker class and the extension this is mixed into.
    vllm_config: Any
    model_runner: Any
    _policyworker_drafter: Any
    # vllm_worker's loader (layerwise reload, drafter routing), set on the extension class:
    # vllm_worker imports this module, so this module cannot import it
    _checkpoint_engine_loader: Any

    def checkpoint_engine_set_refit_info(self, refit_info: Mapping[str, Any]) -> None:
        """What every refit must carry (``encode_refit_info(worker.prepare_refit_info())``);
        call it again when the trainer's refit info changes. An engine set up already stays
        (one engine per process, NeMo-RL's rule).

        Raises:
            ValueError: a dtype this protocol does not know, or ``draft.*`` tensors for an
                engine without a speculative drafter.
        """
        init = {"address": None, "refit_info": refit_info}
        model = self.model_runner.get_model()
        load, info = self._checkpoint_engine_loader(
            model, self.vllm_config.model_config, init, self._policyworker_drafter()
        )
        old = getattr(self, "_checkpoint_engine_rollout", None)
        # vLLM's worker rank inside its engine (tensor x pipeline); the driver adds the prefix
        rollout = CheckpointEngineRollout(
            load, refit_info=info, atomic=True, rank=int(getattr(self, "rank", 0))
        )
        if old is not None:
            rollout.checkpoint_engine, rollout.backend = old.checkpoint_engine, old.backend
        self._checkpoint_engine_rollout = rollout

    def checkpoint_engine_rpc(self, checkpoint_method: str, method_args: Sequence[Any] = ()) -> Any:
        """NeMo-RL's generation-side dispatch, as ``CheckpointEngineRollout``'s."""
        return self._checkpoint_engine_host(checkpoint_method).checkpoint_engine_rpc(
            checkpoint_method, tuple(method_args)
        )

    def checkpoint_engine_last_report(self) -> dict[str, Any] | None:
        """The last refit's summary (version, tensors, bytes, buckets, seconds), or None."""
        rollout = getattr(self, "_checkpoint_engine_rollout", None)
        report = None if rollout is None else rollout.last_report
        return None if report is None else report.summary()

    def _checkpoint_engine_host(self, call: str) -> CheckpointEngineRollout:
        rollout = getattr(self, "_checkpoint_engine_rollout", None)
        if rollout is None:
            msg = (
                f"checkpoint_engine_rpc({call!r}) before checkpoint_engine_set_refit_info: hand "
                "every vLLM worker encode_refit_info(worker.prepare_refit_info()) first "
                "(llm.collective_rpc('checkpoint_engine_set_refit_info', args=(info,)))"
            )
            raise RefitError(msg)
        return rollout

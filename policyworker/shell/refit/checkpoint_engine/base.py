"""``CheckpointEngine``: the contract every checkpoint-engine backend fulfils (NeMo-RL's names).

A backend moves one refit's ``(hf_name, tensor)`` stream from the policy ranks to the rollout
ranks. Its lifecycle, driven the same way on both sides:

1. ``prepare()`` -> serializable metadata of this rank (an address, a port, agent metadata);
2. the driver gathers every rank's metadata, policy ranks first (train rank order), then rollout
   ranks (rollout rank order), and hands the list to ``init_policy_process_group`` /
   ``init_rollout_process_group`` on every member;
3. per refit: ``send_weights(weights, refit_info=...)`` on every policy rank together with
   ``receive_weights(receiver)`` on every rollout rank;
4. ``finalize()`` releases the per-refit resources (a new ``prepare`` starts over).

It is an abstract base class rather than a ``Protocol`` because NeMo-RL's engines subclass its
``CheckpointEngine`` the same way, so an engine written for either lands here by
``module:ClassName`` without an adapter.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import torch

from policyworker.shell.refit.receiver import HFWeightReceiver, RefitReport

__all__ = ["CheckpointEngine", "check_engine_kwargs", "check_topology"]


def check_topology(
    *, rank: int, side: str, train_world_size: int, rollout_world_size: int, metadata: Sequence[Any]
) -> None:
    """``ValueError`` unless the sizes, this rank and the metadata list fit together.

    ``side`` is ``"policy"`` (``rank`` in ``[0, T)``) or ``"rollout"`` (``rank`` in ``[0, R)``).
    """
    for key, value in (
        ("train_world_size", train_world_size),
        ("rollout_world_size", rollout_world_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            msg = f"{key} {value!r} must be an int >= 1 (the number of {key.split('_')[0]} ranks)"
            raise ValueError(msg)
    high = train_world_size if side == "policy" else rollout_world_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < high:
        msg = f"{side} rank {rank!r} must be an int in [0, {high})"
        raise ValueError(msg)
    if not isinstance(metadata, Sequence) or len(metadata) != train_world_size + rollout_world_size:
        got = len(metadata) if isinstance(metadata, Sequence) else type(metadata).__name__
        msg = (
            f"metadata has {got} entries; it must hold every rank's prepare() result, policy "
            f"ranks then rollout ranks: {train_world_size} + {rollout_world_size}"
        )
        raise ValueError(msg)


def check_engine_kwargs(backend: str, kwargs: Mapping[str, Any], accepted: Sequence[str]) -> None:
    """``ValueError`` naming every key of ``kwargs`` a backend does not take, before any state."""
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        msg = (
            f"engine_kwargs {unknown} are not options of the {backend!r} checkpoint engine; "
            f"accepted: {sorted(accepted)}"
        )
        raise ValueError(msg)


class CheckpointEngine(abc.ABC):
    """One rank's end of a checkpoint-engine transfer (policy or rollout side)."""

    # NeMo-RL's flag for backends that send each rollout rank only its expert shard.
    shard_expert_weights: bool = False

    def get_target_weight_layout(self) -> dict[str, Any] | None:
        """The destination-local layout this policy rank sends (None: whole HF tensors)."""
        return None

    @abc.abstractmethod
    def prepare(self) -> Any:
        """Allocate this rank's resources; return serializable metadata for the peers."""

    @abc.abstractmethod
    def init_policy_process_group(
        self,
        *,
        worker_rank: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: list[Any],
    ) -> None:
        """Connect policy rank ``worker_rank`` to its peers (blocks until they joined)."""

    @abc.abstractmethod
    def init_rollout_process_group(
        self,
        *,
        rollout_rank: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: list[Any],
    ) -> None:
        """Connect rollout rank ``rollout_rank`` to its peers (blocks until they joined)."""

    @abc.abstractmethod
    async def send_weights(
        self,
        weights: Iterator[tuple[str, torch.Tensor]],
        *,
        refit_info: Mapping[str, Any] | None = None,
    ) -> Any:
        """Send one refit from this policy rank; every policy rank calls it together.

        ``refit_info`` (``{hf_name: (shape, dtype)}`` in send order) lets a backend announce the
        manifest before any byte; without it a backend that needs it materializes ``weights``.
        """

    @abc.abstractmethod
    def receive_weights(self, receiver: HFWeightReceiver) -> RefitReport:
        """Receive one refit on this rollout rank into ``receiver`` (validated, then written)."""

    async def receive_weight_batches(
        self, *, refit_info: Mapping[str, Any]
    ) -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
        """NeMo-RL's rollout-side form: the refit as batches of ``(name, tensor)`` (copies),
        yielded once the whole refit arrived and was checked against ``refit_info``."""
        batches: list[list[tuple[str, torch.Tensor]]] = []

        def keep(pairs: Any) -> None:  # the tensors are only valid during this call
            batches.append([(name, tensor.clone()) for name, tensor in pairs])

        self.receive_weights(HFWeightReceiver.socketless(keep, refit_info=refit_info))
        for batch in batches:
            yield batch

    def finalize(self) -> None:  # noqa: B027 -- optional: an engine may hold nothing per refit
        """Release the per-refit resources (connections, groups, buffers)."""

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

__all__ = ["CheckpointEngine", "check_engine_kwargs", "check_topology", "one_pass_option"]


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


def one_pass_option(options: Mapping[str, Any]) -> bool | None:
    """``engine_kwargs``' ``one_pass`` (None when absent); ``ValueError`` unless None or a bool."""
    one_pass = options.get("one_pass")
    if one_pass is not None and not isinstance(one_pass, bool):
        msg = (
            f"engine_kwargs one_pass {one_pass!r} must be None (one-pass where the rollout "
            "side registers its memory, else staged), True (one-pass only) or False (staged)"
        )
        raise ValueError(msg)
    return one_pass


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

    def init_policy_process_group(
        self,
        *,
        worker_rank: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: list[Any],
    ) -> None:
        """Connect policy rank ``worker_rank`` to its peers (blocks until they joined).

        Raises:
            ValueError: before any state changes, sizes, rank or metadata that do not fit
                (``check_topology``, ``check_metadata``) or the backend's own refusal.
        """
        check_topology(
            rank=worker_rank,
            side="policy",
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
        )
        self.check_metadata(metadata)
        self.join_policy(worker_rank, train_world_size, rollout_world_size, metadata)

    def init_rollout_process_group(
        self,
        *,
        rollout_rank: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: list[Any],
    ) -> None:
        """Connect rollout rank ``rollout_rank`` to its peers (blocks until they joined); the
        errors of ``init_policy_process_group``."""
        check_topology(
            rank=rollout_rank,
            side="rollout",
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
        )
        self.check_metadata(metadata)
        self.join_rollout(rollout_rank, train_world_size, rollout_world_size, metadata)

    # The backend's name in its prepare() metadata ({"backend": ..., "device": <type>, ...}):
    # set, ``check_metadata`` refuses a list with another engine's entries or device types.
    metadata_backend: str | None = None
    # what runs on each device type, named when members disagree on it
    device_hint: str = ""

    def check_metadata(self, metadata: Sequence[Any]) -> None:
        """``ValueError`` unless every entry is this backend's ``prepare()`` result offering
        this engine's device type (nothing checked without ``metadata_backend``)."""
        name = self.metadata_backend
        if name is None:
            return
        if not all(isinstance(m, Mapping) and m.get("backend") == name for m in metadata):
            msg = (
                f"metadata must be every member's {name} prepare() result (dicts with "
                f"backend={name!r}), policy ranks first; got {list(metadata)!r}"
            )
            raise ValueError(msg)
        device = getattr(self, "device", None)
        devices = sorted({str(m.get("device")) for m in metadata})
        if isinstance(device, torch.device) and devices != [device.type]:
            msg = (
                f"members offer devices {devices}, this one {device.type!r}: pass the same "
                f"engine_kwargs 'device' type to every member ({self.device_hint})"
            )
            raise ValueError(msg)

    def join_policy(self, worker_rank: int, train: int, rollout: int, metadata: list[Any]) -> None:
        """Join as policy rank ``worker_rank``, the arguments checked (a backend's own part)."""
        msg = f"{type(self).__name__} implements neither init_policy_process_group nor join_policy"
        raise NotImplementedError(msg)

    def join_rollout(
        self, rollout_rank: int, train: int, rollout: int, metadata: list[Any]
    ) -> None:
        """Join as rollout rank ``rollout_rank``, the arguments checked (a backend's own part)."""
        msg = (
            f"{type(self).__name__} implements neither init_rollout_process_group nor join_rollout"
        )
        raise NotImplementedError(msg)

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

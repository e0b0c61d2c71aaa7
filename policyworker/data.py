"""The batch container: ``BatchedDataDict`` (NeMo-RL's, same methods); ``validate_batch``.

A ``BatchedDataDict`` maps keys to tensors or lists that share dim 0 (the batch). Tensors are
right-padded: for every tensor with ``ndim >= 2``, dim 1 is the sequence. Sharding for
data-parallel ranks (plain, dynamic batching, sequence packing) follows NeMo-RL's
``shard_by_batch_size``; the planning math lives in ``policyworker.functional.batching`` and
``...packing``, the dynamic and packed sharding in ``policyworker.data_sharding``.
``validate_batch`` and the loss checks live in
``policyworker.functional.data_checks`` and stay importable from here.
"""

import copy as _copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Self

import torch

from policyworker import data_sharding
from policyworker.data_sharding import MICROBATCH_ORDERS, MicrobatchOrder
from policyworker.errors import DataError
from policyworker.functional.batching import inverse_permutation
from policyworker.functional.data_checks import (
    batch_rows,
    check_loss_fn,
    train_required_keys,
    validate_batch,
)

__all__ = [
    "MICROBATCH_ORDERS",
    "BatchedDataDict",
    "MicrobatchOrder",
    "check_loss_fn",
    "train_required_keys",
    "validate_batch",
]


Indices = Sequence[int] | torch.Tensor


def _take(value: Any, indices: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(indices, dtype=torch.long, device=value.device)]
    if isinstance(value, list | tuple):
        return [value[i] for i in indices]
    raise DataError(f"values must be tensors or lists, got {type(value).__name__}")


def _batch_rows(batch: Mapping[str, Any], index: int) -> int:
    sizes = {batch_rows(value, key) for key, value in batch.items()}
    if len(sizes) > 1:
        raise DataError(
            f"batch {index} has keys with different row counts {sorted(sizes)}; "
            "every value needs the same dim 0"
        )
    return next(iter(sizes), 0)


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


class BatchedDataDict(dict[str, Any]):
    """A dict of batch-aligned tensors/lists with slicing, sharding and microbatching helpers.

    Shards made by :meth:`shard_by_batch_size` with dynamic batching or packing carry
    ``micro_batch_indices`` (per global batch, ``[start, end)`` row ranges), ``micro_batch_lengths``
    (per global batch, the width or packed load of each microbatch) and, for packing,
    ``elem_counts_per_gb`` (rows per global batch).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: list[list[list[int]]] | None = None
        self.micro_batch_lengths: list[list[int]] | None = None
        self.elem_counts_per_gb: list[int] | None = None

    # -- basic access ---------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The batch size (0 for an empty dict); every key must agree."""
        sizes = {k: batch_rows(v, k) for k, v in self.items()}
        if len(set(sizes.values())) > 1:
            raise DataError(
                f"Batch sizes are not the same across the rollout batch: {sizes}; every value "
                "needs the same dim 0"
            )
        return next(iter(sizes.values()), 0)

    def to(self, device: str | torch.device) -> Self:
        """Move every tensor to ``device`` in place; returns ``self``."""
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                self[k] = v.to(device)
        return self

    def get_dict(self) -> dict[str, Any]:
        """A plain ``dict`` with the same values."""
        return dict(self)

    def copy(self) -> Self:  # type: ignore[override]
        """A shallow copy that keeps the microbatch attributes."""
        out = type(self)(self)
        out.micro_batch_indices = _copy.deepcopy(self.micro_batch_indices)
        out.micro_batch_lengths = _copy.deepcopy(self.micro_batch_lengths)
        out.elem_counts_per_gb = _copy.deepcopy(self.elem_counts_per_gb)
        return out

    def slice(self, start: int, end: int) -> Self:
        """Rows ``[start, end)`` as a new dict (tensor values are views)."""
        size = self.size
        if not 0 <= start <= end <= size:
            raise ValueError(
                f"slice [{start}, {end}) must satisfy 0 <= start <= end <= size {size}"
            )
        return type(self)({k: v[start:end] for k, v in self.items()})

    def select_indices(self, indices: Indices) -> Self:
        """The given rows, in the given order, as a new dict."""
        rows = _ints(indices)
        size = self.size
        bad = [i for i in rows if not -size <= i < size]
        if bad:
            raise ValueError(f"indices {bad[:8]} are out of range for batch size {size}")
        return type(self)({k: _take(v, rows) for k, v in self.items()})

    def reorder_data(self, indices: Indices) -> Self:
        """Undo a permutation IN PLACE, as NeMo-RL does: ``indices[i]`` is the original position
        of current row ``i``, so afterwards row ``indices[i]`` holds what row ``i`` held.

        Returns ``self`` (NeMo-RL returns None) so ``b.reorder_data(order)`` chains. Raises
        before changing anything when ``indices`` is not a permutation of the rows.
        """
        rows, size = _ints(indices), self.size
        if sorted(rows) != list(range(size)):
            raise ValueError(
                f"reorder_data needs a permutation of range({size}) (one original position per "
                f"row, each once), got {rows[:16]}{' ...' if len(rows) > 16 else ''}"
            )
        order = inverse_permutation(rows)
        reordered = {k: _take(v, _ints(order)) for k, v in self.items()}
        self.update(reordered)
        return self

    def repeat_interleave(self, num_repeats: int) -> Self:
        """Repeat every row ``num_repeats`` times, keeping row order: ``[a, b] -> [a, a, b, b]``."""
        if num_repeats < 1:
            raise ValueError(f"num_repeats must be >= 1, got {num_repeats}")
        out = type(self)()
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.repeat_interleave(num_repeats, dim=0)
            else:
                out[k] = [_copy.deepcopy(item) for item in v for _ in range(num_repeats)]
        return out

    def truncate_tensors(self, dim: int, truncated_len: int) -> Self:
        """Cut every tensor with more than ``dim`` dims to at most ``truncated_len`` on ``dim``.

        In place (as the reference); returns ``self``.
        """
        for k, v in self.items():
            if isinstance(v, torch.Tensor) and v.ndim > dim:
                self[k] = v.narrow(dim, 0, min(truncated_len, v.shape[dim]))
        return self

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, int | float] | None = None,
    ) -> Self:
        """Concatenate batches along dim 0; tensors with ndim >= 2 are right-padded on dim 1.

        Pad values come from ``pad_value_dict`` (default 0). Lists are concatenated. As in
        NeMo-RL, no batches give an empty dict and an empty batch (no rows) may lack keys; a key
        missing from a batch that has rows is an error.
        """
        keys = list(dict.fromkeys(k for batch in batches for k in batch))
        rows = [_batch_rows(batch, i) for i, batch in enumerate(batches)]
        for key in keys:
            lacking = [i for i, batch in enumerate(batches) if key not in batch and rows[i]]
            if lacking:
                raise DataError(
                    f"key {key!r} is missing from non-empty batches {lacking} (rows: "
                    f"{[rows[i] for i in lacking]}); every batch with rows needs every key "
                    "(only empty batches may lack keys)"
                )
        pads = dict(pad_value_dict or {})
        return cls(
            {k: _concat_values(k, [b[k] for b in batches if k in b], pads.get(k, 0)) for k in keys}
        )

    # -- microbatching --------------------------------------------------------------------------

    def make_microbatch_iterator(self, mbs: int) -> Iterator[Self]:
        """Consecutive slices of ``mbs`` rows."""
        size = self.size
        if mbs < 1 or size % mbs:
            raise ValueError(
                f"Data dict size ({size}) is not a multiple of the microbatch size ({mbs}); pick "
                "a microbatch size that divides the batch"
            )
        for start in range(0, size, mbs):
            yield self.slice(start, start + mbs)

    def _single_gb_plan(self) -> tuple[list[list[int]], list[int]]:
        if self.micro_batch_indices is None or self.micro_batch_lengths is None:
            raise ValueError(
                "this dict has no microbatch plan; shard it with "
                "dynamic_batching_args or sequence_packing_args first"
            )
        if len(self.micro_batch_indices) != 1:
            raise ValueError(
                f"this dict holds {len(self.micro_batch_indices)} global batches; "
                "call get_batch(i) first"
            )
        return self.micro_batch_indices[0], self.micro_batch_lengths[0]

    def make_microbatch_iterator_with_dynamic_shapes(self, sequence_dim: int = 1) -> Iterator[Self]:
        """The dynamic-batching microbatches of one global batch, each cut to its width."""
        indices, lengths = self._single_gb_plan()
        for (start, end), width in zip(indices, lengths, strict=True):
            yield self.slice(start, end).truncate_tensors(sequence_dim, width)

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator[Self]:
        """The packing microbatches (bins) of one global batch."""
        indices, _ = self._single_gb_plan()
        for start, end in indices:
            yield self.slice(start, end)

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> Self:
        """Global batch ``batch_idx`` of a shard, with its microbatch attributes.

        Uses ``elem_counts_per_gb`` when present (packing), else rows
        ``[batch_idx * batch_size, (batch_idx + 1) * batch_size)``.
        """
        if self.elem_counts_per_gb is not None:
            counts = self.elem_counts_per_gb
            if not 0 <= batch_idx < len(counts):
                raise ValueError(
                    f"batch_idx {batch_idx} out of range: this shard has "
                    f"{len(counts)} global batches"
                )
            start = sum(counts[:batch_idx])
            batch = self.slice(start, start + counts[batch_idx])
            batch.elem_counts_per_gb = [counts[batch_idx]]
        else:
            if batch_size is None or batch_size < 1:
                raise ValueError(
                    f"batch_size must be >= 1 for a dict without "
                    f"elem_counts_per_gb, got {batch_size}"
                )
            batch = self.slice(batch_size * batch_idx, batch_size * (batch_idx + 1))
        if self.micro_batch_indices is not None and self.micro_batch_lengths is not None:
            batch.micro_batch_indices = [_copy.deepcopy(self.micro_batch_indices[batch_idx])]
            batch.micro_batch_lengths = [list(self.micro_batch_lengths[batch_idx])]
        return batch

    # -- sharding -------------------------------------------------------------------------------

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: Mapping[str, Any] | None = None,
        sequence_packing_args: Mapping[str, Any] | None = None,
    ) -> list[Self] | tuple[list[Self], list[int]]:
        """Split into ``shards`` data-parallel shards, one global batch at a time (as NeMo-RL does).

        The data is cut into chunks of ``batch_size`` rows (one per global batch; default: all
        rows). Plain: shard ``r`` gets rows ``[r*bs/shards, (r+1)*bs/shards)`` of every chunk.
        Dynamic batching: each chunk is sorted by length and strided over the shards, and every
        shard gets the same token-budget microbatch boundaries. Packing: each chunk is bin-packed
        into a multiple of ``shards`` bins, dealt round-robin. The last two return
        ``(shards, sorted_indices)`` where ``sorted_indices`` lists the original row of every row
        of the concatenated shards, so ``from_batches(shards).reorder_data(sorted_indices)``
        restores this dict.

        Example: rows ``[0..7]``, ``batch_size=4``, ``shards=2`` -> ``[0, 1, 4, 5]`` and
        ``[2, 3, 6, 7]``.
        """
        total, batch_size = data_sharding.check_shard_arguments(
            self,
            shards,
            batch_size,
            allow_uneven_shards,
            dynamic_batching_args,
            sequence_packing_args,
        )
        if sequence_packing_args is not None:
            return data_sharding.shard_packed(self, shards, batch_size, sequence_packing_args)
        if dynamic_batching_args is not None:
            return data_sharding.shard_dynamic(self, shards, batch_size, dynamic_batching_args)
        shard_size = -(-batch_size // shards)
        result = []
        for r in range(shards):
            rows = [
                i
                for start in range(0, total, batch_size)
                for i in range(start + r * shard_size, min(start + (r + 1) * shard_size, total))
            ]
            result.append(self.select_indices(rows))
        return result


def _concat_values(key: str, values: list[Any], pad_value: int | float) -> Any:
    if all(isinstance(v, list | tuple) for v in values):
        return [item for v in values for item in v]
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise DataError(
            f"key {key!r} mixes tensors and lists across batches "
            f"({[type(v).__name__ for v in values]}); use one type per key"
        )
    ndims = {v.ndim for v in values}
    if len(ndims) != 1 or 0 in ndims:
        raise DataError(
            f"key {key!r} has tensors of shapes {[tuple(v.shape) for v in values]}; "
            "every batch needs the same number of dims (>= 1)"
        )
    if ndims == {1}:
        return torch.cat(values)
    width = max(v.shape[1] for v in values)
    padded = [
        torch.nn.functional.pad(v, (0, 0) * (v.ndim - 2) + (0, width - v.shape[1]), value=pad_value)
        if v.shape[1] < width
        else v
        for v in values
    ]
    return torch.cat(padded)

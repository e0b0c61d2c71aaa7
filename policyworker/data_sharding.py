"""How ``BatchedDataDict.shard_by_batch_size`` deals rows to data-parallel shards with dynamic
batching or sequence packing, and the checks of its arguments (NeMo-RL's semantics).

Each function takes the dict being sharded (``batch``) and returns new dicts built with its
``select_indices``; the planning math lives in ``policyworker.functional.batching`` and
``...packing``.
"""

import copy as _copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import torch

from policyworker.errors import DataError
from policyworker.functional.batching import round_up, token_budget_boundaries
from policyworker.functional.packing import pack_into_bins

__all__ = [
    "MICROBATCH_ORDERS",
    "MicrobatchOrder",
    "check_shard_arguments",
    "shard_dynamic",
    "shard_packed",
]

MicrobatchOrder = Literal["packer", "largest_first"]
MICROBATCH_ORDERS: tuple[str, ...] = get_args(MicrobatchOrder)
_DYNAMIC_KEYS = (
    "max_tokens_per_microbatch",
    "sequence_length_round",
    "input_key",
    "input_lengths_key",
)
_PACKING_KEYS = ("max_tokens_per_microbatch", "input_key", "input_lengths_key", "algorithm")


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


def _require_keys(args: Mapping[str, Any], keys: Sequence[str], what: str) -> None:
    missing = [k for k in keys if k not in args]
    if missing:
        raise ValueError(f"{what} is missing {missing}; it needs {list(keys)}")


def check_shard_arguments(
    batch: Any,
    shards: int,
    batch_size: int | None,
    allow_uneven_shards: bool,
    dynamic_args: Mapping[str, Any] | None,
    packing_args: Mapping[str, Any] | None,
) -> tuple[int, int]:
    if dynamic_args is not None and packing_args is not None:
        raise DataError(
            "dynamic_batching_args and sequence_packing_args cannot be passed together; pick one"
        )
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if allow_uneven_shards and (batch_size is not None or dynamic_args is not None):
        raise ValueError(
            "allow_uneven_shards=True needs batch_size=None and no "
            "dynamic_batching_args (every dynamic shard must be equally long)"
        )
    total: int = batch.size
    batch_size = total if batch_size is None else batch_size
    if batch_size < 1 or total % batch_size:
        raise DataError(
            f"Total batch size ({total}) is not a multiple of batch_size "
            f"({batch_size}); pass a batch_size that divides it"
        )
    if not allow_uneven_shards and batch_size % shards:
        raise DataError(
            f"Batch size ({batch_size}) is not a multiple of shards ({shards}); "
            "pass allow_uneven_shards=True or a divisible batch_size"
        )
    if dynamic_args is not None:
        _require_keys(dynamic_args, _DYNAMIC_KEYS, "dynamic_batching_args")
    if packing_args is not None:
        _require_keys(packing_args, _PACKING_KEYS, "sequence_packing_args")
        order = packing_args.get("microbatch_order", "packer")
        if order not in MICROBATCH_ORDERS:
            raise ValueError(
                f"sequence_packing_args['microbatch_order'] must be one of "
                f"{list(MICROBATCH_ORDERS)}, got {order!r}"
            )
    for args in (dynamic_args, packing_args):
        if args is not None:
            for key in (args["input_key"], args["input_lengths_key"]):
                if key not in batch:
                    raise DataError(
                        f"key {key!r} named in the sharding args is not in the "
                        f"batch (keys: {sorted(batch)})"
                    )
    return total, batch_size


def shard_dynamic(
    batch: Any, shards: int, batch_size: int, args: Mapping[str, Any]
) -> tuple[list[Any], list[int]]:
    lengths = _ints(batch[args["input_lengths_key"]])
    seq_len = batch[args["input_key"]].shape[1]
    max_tokens = int(args["max_tokens_per_microbatch"])
    rounding = int(args["sequence_length_round"])
    rows_per_shard: list[list[int]] = [[] for _ in range(shards)]
    indices: list[list[list[int]]] = []
    widths_per_gb: list[list[int]] = []
    for start in range(0, len(lengths), batch_size):
        ordered = sorted(range(start, start + batch_size), key=lambda i: lengths[i])
        strided = [ordered[r::shards] for r in range(shards)]
        widths = []
        for position in range(batch_size // shards):
            longest = max((strided[r][position] for r in range(shards)), key=lambda i: lengths[i])
            width = min(round_up(max(lengths[longest], 1), rounding), seq_len)
            if width > max_tokens:
                raise DataError(
                    f"row {longest} has {args['input_lengths_key']!r} {lengths[longest]} "
                    f"(width {width} after rounding to {rounding}) > max_tokens_per_microbatch "
                    f"{max_tokens}; raise max_tokens_per_microbatch or truncate the row"
                )
            widths.append(width)
        groups = token_budget_boundaries(widths, max_tokens=max_tokens)
        indices.append([[s, e] for s, e, _ in groups])
        widths_per_gb.append([w for _, _, w in groups])
        for r in range(shards):
            rows_per_shard[r].extend(strided[r])
    result = [batch.select_indices(rows) for rows in rows_per_shard]
    for shard in result:
        shard.micro_batch_indices = _copy.deepcopy(indices)
        shard.micro_batch_lengths = _copy.deepcopy(widths_per_gb)
    return result, [i for rows in rows_per_shard for i in rows]


def shard_packed(
    batch: Any, shards: int, batch_size: int, args: Mapping[str, Any]
) -> tuple[list[Any], list[int]]:
    lengths = _ints(batch[args["input_lengths_key"]])
    capacity = int(args["max_tokens_per_microbatch"])
    multiple = int(args.get("sequence_length_pad_multiple", 1))
    padded = [round_up(n, multiple) for n in lengths]
    for row, (n, p) in enumerate(zip(lengths, padded, strict=True)):
        if p > capacity:
            raise DataError(
                f"row {row} has {args['input_lengths_key']!r} {n} (padded to {p} with "
                f"sequence_length_pad_multiple {multiple}) > max_tokens_per_microbatch "
                f"{capacity}; raise max_tokens_per_microbatch to at least the longest padded "
                "sequence"
            )
    rows_per_shard: list[list[int]] = [[] for _ in range(shards)]
    plans: list[tuple[list[list[list[int]]], list[list[int]], list[int]]] = [
        ([], [], []) for _ in range(shards)
    ]
    for start in range(0, len(lengths), batch_size):
        bins = pack_into_bins(
            padded[start : start + batch_size],
            capacity,
            algorithm=args["algorithm"],
            min_bin_count=shards,
            bin_count_multiple=shards,
        )
        for r in range(shards):
            mine = [[start + i for i in b] for b in bins[r::shards]]
            if args.get("microbatch_order", "packer") == "largest_first":
                mine.sort(key=lambda b: -sum(padded[i] for i in b))  # stable
            bounds = [sum(len(b) for b in mine[:k]) for k in range(len(mine) + 1)]
            plans[r][0].append([[bounds[k], bounds[k + 1]] for k in range(len(mine))])
            plans[r][1].append([sum(padded[i] for i in b) for b in mine])
            plans[r][2].append(bounds[-1])
            rows_per_shard[r].extend(i for b in mine for i in b)
    result = []
    for rows, (indices, loads, counts) in zip(rows_per_shard, plans, strict=True):
        shard = batch.select_indices(rows)
        shard.micro_batch_indices, shard.micro_batch_lengths = indices, loads
        shard.elem_counts_per_gb = counts
        result.append(shard)
    return result, [i for rows in rows_per_shard for i in rows]

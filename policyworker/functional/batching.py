"""Microbatch plans: fixed size, token-budget (dynamic), packed; dummy padding; reordering.

A plan set is a list of :class:`MicrobatchPlan`; the real (non-dummy) plans of a set cover every
row of the batch exactly once. A worker runs the plans in order, concatenates their outputs, and
restores input order with :func:`rows_in_input_order`::

    plans = dynamic_microbatches([5, 1, 7, 2], max_tokens=16, sequence_length_round=4, seq_len=8)
      rows sorted by length: 1 (w 4), 3 (w 4), 0 (w 8), 2 (w 8)
      grow while (count + 1) * max_width <= 16:  (1, 3) width 4 | (0, 2) width 8
    outputs = torch.cat([run(plan) for plan in plans])      # rows 1, 3, 0, 2
    outputs[rows_in_input_order(plans)]                       # rows 0, 1, 2, 3

All functions are pure: they never modify their arguments and read no runtime state.
"""

from collections.abc import Sequence
from typing import Literal

import attrs
import torch

from policyworker.functional.packing import PackingAlgorithm, int_list, pack_into_bins

__all__ = [
    "MicrobatchPlan",
    "MicrobatchSpec",
    "dummy_microbatches",
    "dynamic_microbatches",
    "fixed_microbatches",
    "inverse_permutation",
    "num_dummy_microbatches",
    "packed_microbatches",
    "plan_microbatches",
    "round_up",
    "rows_in_input_order",
    "token_budget_boundaries",
]


@attrs.frozen
class MicrobatchPlan:
    """One microbatch: which rows (indices into the batch) and the sequence width to slice to.

    For packed plans ``width`` is the bin's load: the sum of the rows' lengths rounded up to the
    pad multiple (at most the capacity). Dummy plans only keep collectives in lockstep; their
    outputs are discarded.
    """

    rows: tuple[int, ...] = attrs.field(converter=tuple)
    width: int
    packed: bool = False
    is_dummy: bool = False


@attrs.frozen(kw_only=True)
class MicrobatchSpec:
    """How one pass cuts a rank's rows into microbatches, as plain values.

    ``fixed``: ``mbs`` rows at a time. ``dynamic``: rows sorted by length, grown while the
    padded width times the row count fits ``token_budget`` (widths rounded to
    ``sequence_length_round``). ``packed``: whole sequences packed into bins of ``token_budget``
    tokens by ``algorithm``, each length rounded up to ``pad_multiple``.
    """

    kind: Literal["fixed", "dynamic", "packed"] = "fixed"
    token_budget: int = 0
    sequence_length_round: int = 1
    algorithm: PackingAlgorithm = "modified_first_fit_decreasing"
    pad_multiple: int = 1

    def __attrs_post_init__(self) -> None:
        if self.kind != "fixed" and self.token_budget < 1:
            raise ValueError(
                f"a {self.kind} microbatch spec needs token_budget >= 1, got {self.token_budget}"
            )


def plan_microbatches(
    spec: MicrobatchSpec, lengths_B: torch.Tensor, *, seq_len: int, mbs: int
) -> list["MicrobatchPlan"]:
    """This rank's fixed / dynamic / packed microbatch plans for rows of `lengths_B`."""
    if spec.kind == "fixed":
        return fixed_microbatches(int(lengths_B.shape[0]), mbs, seq_len=seq_len)
    if spec.kind == "dynamic":
        return dynamic_microbatches(
            lengths_B,
            max_tokens=spec.token_budget,
            seq_len=seq_len,
            sequence_length_round=spec.sequence_length_round,
        )
    return packed_microbatches(
        lengths_B,
        capacity=spec.token_budget,
        algorithm=spec.algorithm,
        pad_multiple=spec.pad_multiple,
    )


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= n``."""
    return -(-n // multiple) * multiple


def fixed_microbatches(
    batch_size: int, micro_batch_size: int, *, seq_len: int
) -> list[MicrobatchPlan]:
    """Consecutive rows ``micro_batch_size`` at a time, full width; the last plan may be shorter.

    Raises:
        ValueError: ``micro_batch_size < 1`` or ``batch_size < 0``.
    """
    if micro_batch_size < 1 or batch_size < 0:
        raise ValueError(
            f"micro_batch_size must be >= 1 and batch_size >= 0, got {micro_batch_size} and "
            f"{batch_size}"
        )
    return [
        MicrobatchPlan(
            rows=tuple(range(start, min(start + micro_batch_size, batch_size))), width=seq_len
        )
        for start in range(0, batch_size, micro_batch_size)
    ]


def token_budget_boundaries(
    widths: Sequence[int], *, max_tokens: int
) -> list[tuple[int, int, int]]:
    """Greedy ``(start, end, width)`` groups of consecutive positions under a token budget.

    A group grows while ``(count + 1) * max(width so far, next width) <= max_tokens`` (NeMo-RL's
    dynamic batching rule); its width is the largest width in it.

    Raises:
        ValueError: a single width above ``max_tokens``.
    """
    groups: list[tuple[int, int, int]] = []
    for position, width in enumerate(widths):
        if width > max_tokens:
            raise ValueError(
                f"position {position} needs width {width} > max_tokens {max_tokens}; raise "
                "max_tokens_per_microbatch to at least the longest (rounded) sequence"
            )
        if groups:
            start, end, group_width = groups[-1]
            if (end - start + 1) * max(group_width, width) <= max_tokens:
                groups[-1] = (start, end + 1, max(group_width, width))
                continue
        groups.append((position, position + 1, width))
    return groups


def dynamic_microbatches(
    lengths: Sequence[int] | torch.Tensor,
    *,
    max_tokens: int,
    sequence_length_round: int,
    seq_len: int,
) -> list[MicrobatchPlan]:
    """Token-budget microbatches over the rows sorted by length (stable, ascending).

    A row's width is its length rounded up to ``sequence_length_round`` (at least one round, so
    no plan is empty along the sequence), capped at ``seq_len``; see
    :func:`token_budget_boundaries` for the growth rule.

    Raises:
        ValueError: ``sequence_length_round < 1``; a row whose width exceeds ``max_tokens``.
    """
    if sequence_length_round < 1:
        raise ValueError(f"sequence_length_round must be >= 1, got {sequence_length_round}")
    sizes = int_list(lengths)
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    widths = [min(round_up(max(sizes[i], 1), sequence_length_round), seq_len) for i in order]
    for position, width in enumerate(widths):
        if width > max_tokens:
            raise ValueError(
                f"row {order[position]} has length {sizes[order[position]]} (width {width} after "
                f"rounding to {sequence_length_round}) > max_tokens {max_tokens}; raise "
                "max_tokens_per_microbatch or truncate the row"
            )
    groups = token_budget_boundaries(widths, max_tokens=max_tokens)
    return [MicrobatchPlan(rows=tuple(order[s:e]), width=w) for s, e, w in groups]


def packed_microbatches(
    lengths: Sequence[int] | torch.Tensor,
    *,
    capacity: int,
    algorithm: PackingAlgorithm,
    pad_multiple: int = 1,
    min_bin_count: int = 1,
    bin_count_multiple: int = 1,
) -> list[MicrobatchPlan]:
    """One packed plan per bin of :func:`pack_into_bins` over lengths rounded to ``pad_multiple``.

    An empty batch gives no plans.

    Raises:
        ValueError: ``pad_multiple < 1``; any error of :func:`pack_into_bins`.
    """
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    padded = [round_up(n, pad_multiple) for n in int_list(lengths)]
    if not padded:
        return []
    bins = pack_into_bins(
        padded,
        capacity,
        algorithm=algorithm,
        min_bin_count=min_bin_count,
        bin_count_multiple=bin_count_multiple,
    )
    return [
        MicrobatchPlan(rows=tuple(b), width=sum(padded[i] for i in b), packed=True) for b in bins
    ]


def num_dummy_microbatches(local_count: int, max_count: int) -> int:
    """How many dummy microbatches a rank appends to reach the all-rank maximum."""
    if local_count < 0 or max_count < local_count:
        raise ValueError(
            f"need 0 <= local_count <= max_count, got local_count={local_count}, "
            f"max_count={max_count}; max_count must be the MAX all-reduce of every rank's count"
        )
    return max_count - local_count


def dummy_microbatches(plans: Sequence[MicrobatchPlan], count: int) -> list[MicrobatchPlan]:
    """``count`` cycled copies of ``plans`` marked ``is_dummy=True``."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if count and not plans:
        raise ValueError(
            f"cannot make {count} dummy microbatches from no plans; a rank with no data still "
            "needs one (e.g. a one-row plan) to keep collectives in lockstep"
        )
    return [attrs.evolve(plans[i % len(plans)], is_dummy=True) for i in range(count)]


def inverse_permutation(indices: Sequence[int] | torch.Tensor) -> list[int]:
    """``inverse`` with ``inverse[indices[i]] == i``.

    Raises:
        ValueError: ``indices`` is not a permutation of ``0 .. n-1``.
    """
    values = int_list(indices)
    if sorted(values) != list(range(len(values))):
        missing = sorted(set(range(len(values))) - set(values))
        raise ValueError(
            f"indices must be a permutation of 0..{len(values) - 1}; missing {missing[:8]}, got "
            f"{values[:16]}{'...' if len(values) > 16 else ''}"
        )
    inverse = [0] * len(values)
    for position, value in enumerate(values):
        inverse[value] = position
    return inverse


def rows_in_input_order(plans: Sequence[MicrobatchPlan]) -> list[int]:
    """Index that puts outputs concatenated in plan order back into input row order.

    Dummy plans are skipped. ``torch.cat(outputs)[rows_in_input_order(plans)]`` is in input order.

    Raises:
        ValueError: the real plans do not cover rows ``0 .. n-1`` exactly once.
    """
    return inverse_permutation([r for plan in plans if not plan.is_dummy for r in plan.rows])

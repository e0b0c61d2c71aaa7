"""NeMo-RL's packing names over `policyworker.functional.packing.pack_into_bins`:
`PackingAlgorithm`, `get_packer(algorithm, bin_capacity, ...)` and a packer's `pack(lengths)`."""

import enum
from collections.abc import Sequence
from typing import Any

from policyworker.functional.packing import pack_into_bins

__all__ = ["PackingAlgorithm", "SequencePacker", "get_packer"]


class PackingAlgorithm(enum.Enum):
    """The bin-packing algorithms, valued by the name `sequence_packing.algorithm` takes."""

    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"


class SequencePacker:
    """Packs sequence lengths into bins of at most `bin_capacity` tokens with one algorithm.

    `min_bin_count` / `bin_count_multiple` (None: no constraint) raise the bin count by moving
    single sequences into new bins. `collect_metrics` is accepted; this packer keeps no metrics.

    Raises:
        ValueError: min_bin_count < 0 or bin_count_multiple < 1.
    """

    def __init__(
        self,
        algorithm: PackingAlgorithm,
        bin_capacity: int,
        collect_metrics: bool = False,
        min_bin_count: int | None = None,
        bin_count_multiple: int | None = None,
    ) -> None:
        if min_bin_count is not None and min_bin_count < 0:
            msg = f"min_bin_count must be nonnegative, got {min_bin_count}"
            raise ValueError(msg)
        if bin_count_multiple is not None and bin_count_multiple < 1:
            msg = f"bin_count_multiple must be positive, got {bin_count_multiple}"
            raise ValueError(msg)
        self.algorithm = algorithm
        self.bin_capacity = bin_capacity
        self.collect_metrics = collect_metrics
        self.min_bin_count = min_bin_count
        self.bin_count_multiple = bin_count_multiple
        self.metrics: Any = None

    def pack(self, sequence_lengths: Sequence[int]) -> list[list[int]]:
        """Bins of indices into `sequence_lengths` (no sequences: no bins).

        Raises:
            ValueError: a length above the capacity, or too few sequences for the bin count.
        """
        lengths = [int(n) for n in sequence_lengths]
        least = max(1, self.min_bin_count or 1)
        multiple = self.bin_count_multiple or 1
        target = -(-least // multiple) * multiple
        if lengths and len(lengths) < target:
            msg = (
                f"Cannot create {target} bins with only {len(lengths)} sequences; each bin holds "
                "at least one sequence: lower min_bin_count/bin_count_multiple or pass more "
                "sequences"
            )
            raise ValueError(msg)
        return pack_into_bins(
            lengths,
            self.bin_capacity,
            algorithm=self.algorithm.value,
            min_bin_count=least,
            bin_count_multiple=multiple,
        )


def get_packer(
    algorithm: PackingAlgorithm | str,
    bin_capacity: int,
    collect_metrics: bool = False,
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
) -> SequencePacker:
    """The packer of `algorithm` (an enum member, or its name in any case).

    Raises:
        ValueError: an unknown algorithm, naming the known ones.
    """
    if isinstance(algorithm, str):
        chosen = PackingAlgorithm.__members__.get(algorithm.upper())
    else:
        chosen = algorithm if isinstance(algorithm, PackingAlgorithm) else None
    if chosen is None:
        known = ", ".join(PackingAlgorithm.__members__)
        msg = f"Unknown packing algorithm: {algorithm!r}. Available algorithms: {known}"
        raise ValueError(msg)
    return SequencePacker(
        chosen,
        bin_capacity,
        collect_metrics=collect_metrics,
        min_bin_count=min_bin_count,
        bin_count_multiple=bin_count_multiple,
    )

"""NeMo-RL's names of the `shard_by_batch_size` argument mappings, over `policyworker.data`."""

from typing import Literal, NotRequired, TypedDict

from policyworker.data import BatchedDataDict

__all__ = ["BatchedDataDict", "DynamicBatchingArgs", "SequencePackingArgs"]


class SequencePackingArgs(TypedDict):
    """`sequence_packing_args` of `BatchedDataDict.shard_by_batch_size`."""

    max_tokens_per_microbatch: int
    input_key: str
    input_lengths_key: str
    algorithm: str
    microbatch_order: NotRequired[Literal["packer", "largest_first"]]
    sequence_length_pad_multiple: int


class DynamicBatchingArgs(TypedDict):
    """`dynamic_batching_args` of `BatchedDataDict.shard_by_batch_size`."""

    max_tokens_per_microbatch: int
    sequence_length_round: int
    input_key: str
    input_lengths_key: str

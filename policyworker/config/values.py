"""The value sets of the config: the `Literal` choices of its fields and the precision spellings
that mean a canonical name."""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal

__all__ = [
    "PRECISION_ALIASES",
    "AttnImplementation",
    "DropoutPosition",
    "Float8Recipe",
    "FusionMode",
    "LoraAInit",
    "LoraComputeDtype",
    "LoraReference",
    "MicrobatchOrder",
    "PackingAlgorithm",
    "Precision",
    "RewardModelType",
]

Precision = Literal["float32", "bfloat16", "float16"]
AttnImplementation = Literal["auto", "sdpa", "eager", "flex_attention", "varlen"]
# torch.compile of elementwise work in the training model (shell/kernels/fusion.py); "none"
# runs eager, "auto" is "layer" on CUDA in a single process and "none" otherwise
FusionMode = Literal["auto", "none", "norm_mlp", "layer"]
# torchao's float8 training recipes (`Float8LinearConfig.from_recipe_name`): per-tensor scales, or
# per-row scales (with a high-precision weight-gradient GEMM in the last one)
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
PackingAlgorithm = Literal[
    "modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle", "concatenative"
]
MicrobatchOrder = Literal["packer", "largest_first"]
RewardModelType = Literal["bradley_terry", "regression"]
DropoutPosition = Literal["pre", "post"]
LoraAInit = Literal["xavier", "uniform"]
DataPlaneImpl = Literal["transfer_queue", "in_process"]
DataPlaneBackend = Literal["simple", "mooncake_cpu"]
FetchPolicy = Literal["auto", "independent", "leader_broadcast"]
# dtype of the LoRA adapter matmuls (the adapter parameters stay fp32); shell/model/lora.py resolves
# "auto": bfloat16 on CUDA when the base layers compute in bfloat16, else float32
LoraComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]
# what the reference policy is under LoRA: the weights at construction (a CPU copy) or the base
# model with the adapters switched off (no copy)
LoraReference = Literal["initial", "base"]

# Precision spellings that mean a canonical name (as `functional.dtypes.precision_dtype` reads
# them); the config stores the canonical one, so `precision: bf16` round-trips as "bfloat16".
PRECISION_ALIASES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "float": "float32",
    }
)

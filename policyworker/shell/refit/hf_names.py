"""The checkpoint names and layout of a transformers model, asked of transformers itself.

transformers 5 keeps some tensors in memory in another layout than its checkpoints (MoE
experts fused into 3-D tensors; Mixtral's ``block_sparse_moe`` renamed ``mlp`` and its
``w1/w3/w2`` merged into ``gate_up_proj/down_proj``) and converts back when saving
(``transformers.core_model_loading.revert_weight_conversion``, called by ``save_pretrained``).
A refit must carry the checkpoint's names and layout: that is what ``from_pretrained`` and an
inference engine's ``load_weights`` read. So ``checkpoint_layout`` runs that same reverse
conversion, over meta stand-ins traced so that each checkpoint tensor comes out as a view of
its in-memory source; its (shape, stride, offset) is the ``CheckpointPiece`` the refit stream
cuts from the live tensor (no copy) and the receiver writes into.

Only architectures whose stream is tested against ``save_pretrained`` and ``from_pretrained``
(tests/shell/refit/test_refit_names.py) are accepted; any other ``model_type`` is refused by name.
A module that is not a transformers model (no ``config.model_type``) has no checkpoint
conversion: its state-dict names are its names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from policyworker.errors import UnsupportedModelError
from policyworker.functional.names import CheckpointPiece, check_pieces, whole_piece

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["SUPPORTED_MODEL_TYPES", "checkpoint_layout", "model_type_of", "require_supported_model"]

# Each is covered by tests/shell/refit/test_refit_names.py (stream == save_pretrained, logprobs of
# from_pretrained(stream) == the trainer's).
SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3_text",
    "phi3",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "gpt_oss",
)


class _ViewTracer(torch.Tensor):
    """A meta tensor whose ``.contiguous()`` returns itself: transformers' split ops make their
    chunks contiguous (a copy), which would hide where in the source each chunk lies."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.contiguous:
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


def model_type_of(module: nn.Module) -> str | None:
    """``module.config.model_type``, or None for a module that is not a transformers model."""
    return getattr(getattr(module, "config", None), "model_type", None)


def require_supported_model(module: nn.Module) -> None:
    """Raise UnsupportedModelError for a transformers model whose refit names are unverified."""
    model_type = model_type_of(module)
    if model_type is None or model_type in SUPPORTED_MODEL_TYPES:
        return
    msg = (
        f"model_type {model_type!r} ({type(module).__name__}) is not supported for refit: its "
        f"streamed names are verified against save_pretrained only for "
        f"{list(SUPPORTED_MODEL_TYPES)}. "
        f"Use one of these, or add {model_type!r} to policyworker.shell.refit.hf_names."
        f"SUPPORTED_MODEL_TYPES with a case in tests/shell/refit/test_refit_names.py"
    )
    raise UnsupportedModelError(msg)


def checkpoint_layout(
    module: nn.Module, shapes: Mapping[str, Sequence[int]]
) -> dict[str, tuple[CheckpointPiece, ...]]:
    """``{in-memory name: its checkpoint pieces}`` for the tensors ``save_pretrained`` saves.

    ``shapes``: ``{canonical state-dict name: shape}`` with LoRA adapters and a tied
    ``lm_head.weight`` already left out. Pieces keep transformers' order within a tensor.

    Raises:
        UnsupportedModelError: ``module`` is a transformers model of an unsupported type.
        ValueError: the conversion builds a checkpoint tensor from several in-memory tensors or
            loses elements (not expressible as views).
    """
    module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: ask the HF model
    model_type = model_type_of(module)
    if model_type is None:
        return {name: (whole_piece(name, shape),) for name, shape in shapes.items()}
    require_supported_model(module)
    from transformers.core_model_loading import revert_weight_conversion

    roots = {name: torch.empty(tuple(shape), device="meta") for name, shape in shapes.items()}
    source_of_root = {id(root): name for name, root in roots.items()}
    traced: dict[str, torch.Tensor] = {
        name: root.as_subclass(_ViewTracer) for name, root in roots.items()
    }
    converted = revert_weight_conversion(cast("PreTrainedModel", module), traced)
    pieces: dict[str, list[CheckpointPiece]] = {name: [] for name in shapes}
    for checkpoint_name, tensor in converted.items():
        source = source_of_root.get(id(tensor._base))  # every view's _base is its root
        if source is None:
            msg = (
                f"transformers' checkpoint conversion of model_type {model_type!r} builds "
                f"{checkpoint_name!r} from several in-memory tensors (or a copy); refit streams "
                f"views of single tensors only"
            )
            raise ValueError(msg)
        pieces[source].append(
            CheckpointPiece(
                checkpoint_name,
                tuple(tensor.shape),
                tuple(tensor.stride()),
                int(tensor.storage_offset()),
            )
        )
    for name, shape in shapes.items():
        check_pieces(name, shape, pieces[name])
    return {name: tuple(found) for name, found in pieces.items()}

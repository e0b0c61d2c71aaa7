"""LoRA under tensor parallelism: a TP style whose adapters follow the base layer's sharding.

Use `lora_tp_plan(plan)` with ``parallelize_module`` after `shell.lora.apply_lora`.
"""

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from policyworker.functional.lora import lora_shard_dims
from policyworker.shell.model.lora import LinearLoRA

__all__ = ["LoRALinearParallel", "lora_tp_plan"]


class LoRALinearParallel(ParallelStyle):
    """A TP style for a (possibly LoRA) linear: the base style, plus adapters that follow it.

    On a `LinearLoRA`, the base style shards ``weight``/``bias`` and installs its input/output
    hooks; then the adapters are distributed by `lora_shard_dims` of the base weight's shard dim:
    colwise base (W Shard(0)) -> ``lora_A`` Replicate, ``lora_B`` Shard(0); rowwise base
    (W Shard(1)) -> ``lora_A`` Shard(1), ``lora_B`` Replicate. The adapter path then produces
    exactly the base's output placement (Shard(-1) resp. Partial, reduced with the base output),
    so LoRA adds no collective of its own. Any other module is handed to the base style.
    """

    def __init__(self, base_style: ParallelStyle) -> None:
        self.base_style = base_style
        self.src_data_rank = base_style.src_data_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LinearLoRA):
            return self.base_style._apply(module, device_mesh)
        adapters = {k: module._modules.pop(k) for k in ("lora_A", "lora_B", "dropout")}
        try:
            self.base_style._apply(module, device_mesh)
        finally:
            module._modules.update(adapters)
        placements = getattr(module.weight, "placements", (Replicate(),))
        shard_dims = [p.dim for p in placements if isinstance(p, Shard)]
        a_dim, b_dim = lora_shard_dims(shard_dims[0] if shard_dims else None)
        for sub, dim in ((module.lora_A, a_dim), (module.lora_B, b_dim)):
            placement = Shard(dim) if dim is not None else Replicate()
            weight = sub.weight
            sub.weight = nn.Parameter(
                distribute_tensor(weight.detach(), device_mesh, [placement]),
                requires_grad=weight.requires_grad,
            )
        return module


def lora_tp_plan(base_plan: Mapping[str, Any]) -> dict[str, Any]:
    """Wrap every style of a TP plan (fqn pattern -> ParallelStyle) so LoRA adapters follow it.

    Use the result with ``torch.distributed.tensor.parallel.parallelize_module`` after
    `apply_lora`. Entries on non-LoRA modules behave exactly as the base style.
    """
    out: dict[str, Any] = {}
    for key, style in base_plan.items():
        if not isinstance(style, ParallelStyle):
            msg = (
                f"TP plan entry {key!r} is {type(style).__name__}, not a ParallelStyle; fix the "
                "plan"
            )
            raise ValueError(msg)
        out[key] = style if isinstance(style, LoRALinearParallel) else LoRALinearParallel(style)
    return out

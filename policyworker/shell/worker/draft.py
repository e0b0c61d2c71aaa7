"""Eagle3-style draft co-training: a small draft model trained beside the policy (`policy.draft`).

The draft reads what the policy computed anyway, captured by forward hooks during the policy's
training forward (detached: the draft never changes the policy's gradient):
- the hidden states after the policy's decoder layers `aux_layer_indices`, concatenated and fused
  by `fc` into one hidden vector per position;
- the policy's input embeddings, shifted left by one (position t sees the embedding of token t+1);
- the policy's logits, shifted left by one: the teacher at draft position t is the policy's
  next-token distribution at position t+1.
Its loss is the soft cross-entropy of the draft's distribution against the policy's, summed over
real (t, t+1) pairs and divided by the global batch's number of pairs, then added to the policy's
loss with `loss_weight` (NeMo-RL's `DraftCrossEntropyLossFn` semantics). The draft has its own
optimizer (the policy's settings), clipped and stepped after the policy's step.

Layer layout (Eagle3): the first layer's attention reads [norm(embedding), norm(fused hidden)]
(2H wide); further layers are plain Llama decoder layers; then a final norm and an LM head.

Sequence packing: the captured [1, N, ...] activations are split back into one row per document
before the draft runs, so nothing crosses a document boundary. Data parallelism: the draft is
replicated (rank 0's initial weights are broadcast), its gradients are summed over dp before its
step, and rank 0 writes it in the policy's asynchronous checkpoint save (`checkpoint_folders`).
Its checkpoint folder is a Hugging Face Eagle3 draft that vLLM loads as a speculative model.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from policyworker.shell.checkpoint.api import StageFolder
from policyworker.shell.model.draft_model import (
    Eagle3Draft,
    _draft_config,
    default_aux_layers,
    eagle3_config,
    read_eagle3_config,
)

__all__ = ["DraftTrainer", "Eagle3Draft", "default_aux_layers", "eagle3_config"]

_DRAFT_WEIGHTS = "model.safetensors"
_DRAFT_OPTIMIZER = "optimizer.pt"


class DraftTrainer:
    """The draft model, its optimizer and the hooks that feed it (inert when `cfg.draft` is off)."""

    def __init__(
        self,
        policy: nn.Module,
        cfg: Any,
        *,
        device: torch.device,
        parallel: Any,
        build_optimizer: Any,
    ) -> None:
        self.cfg = cfg.draft
        self.model: Eagle3Draft | None = None
        self.optimizer: Any = None
        self.parallel = parallel
        self._capturing = False
        self._captured: dict[str, torch.Tensor] = {}
        self._pairs = 1.0
        if self.cfg is None:
            return
        # The config refuses tp / cp with a draft: it reads whole sequences and full logits.
        assert parallel.tp_size * parallel.cp_size == 1, (parallel.tp_size, parallel.cp_size)
        layers = _decoder_layers(policy)
        hf: Any = policy  # an HF PreTrainedModel: embeddings and head accessors
        if layers is None or hf.get_output_embeddings() is None:
            msg = (
                f"policy.draft needs a causal LM with decoder layers and an LM head; "
                f"{type(policy).__name__} has no such layout; remove policy.draft"
            )
            raise ValueError(msg)
        self.aux_layers = tuple(self.cfg.aux_layer_indices or default_aux_layers(len(layers)))
        if max(self.aux_layers) >= len(layers):
            msg = (
                f"draft.aux_layer_indices={list(self.aux_layers)} names a layer the policy "
                f"does not have (it has {len(layers)}: 0..{len(layers) - 1}); pick indices "
                f"below {len(layers)}"
            )
            raise ValueError(msg)
        self.model = self._build(policy, num_policy_layers=len(layers)).to(device)
        self._broadcast_from_first_rank()
        self.optimizer = (
            build_optimizer(self.model, cfg.optimizer)
            if build_optimizer is not None and cfg.optimizer
            else None
        )
        self.max_grad_norm = cfg.max_grad_norm
        self._handles = [
            hf.get_input_embeddings().register_forward_hook(self._keep("embeds")),
            hf.get_output_embeddings().register_forward_hook(self._keep("logits")),
        ]
        for index in self.aux_layers:
            self._handles.append(layers[index].register_forward_hook(self._keep(f"aux{index}")))

    def _build(self, policy: nn.Module, *, num_policy_layers: int) -> Eagle3Draft:
        name = self.cfg.model_name
        if name is None:
            config = _draft_config(policy.config, self.cfg.num_layers or 1)
            draft = Eagle3Draft(config, num_aux=len(self.aux_layers))
            with torch.no_grad():  # NeMo-RL: no draft LM head given -> start from the policy's
                hf: Any = policy
                head = hf.get_output_embeddings().weight
                draft.lm_head.weight.copy_(
                    head.full_tensor() if isinstance(head, DTensor) else head
                )
            return draft
        folder = Path(name)
        config, saved_layers = read_eagle3_config(folder, num_policy_layers=num_policy_layers)
        draft = Eagle3Draft(config, num_aux=len(saved_layers))
        if saved_layers != self.aux_layers:
            if self.cfg.aux_layer_indices is not None:
                msg = (
                    f"draft.model_name={name!r} reads policy layers {list(saved_layers)} but "
                    f"draft.aux_layer_indices is {list(self.aux_layers)}; make them agree "
                    f"(or drop draft.aux_layer_indices to use the draft's)"
                )
                raise ValueError(msg)
            self.aux_layers = saved_layers  # the layers the saved draft was trained on
        from safetensors.torch import load_file

        draft.load_state_dict(load_file(str(folder / _DRAFT_WEIGHTS)))
        return draft

    def _broadcast_from_first_rank(self) -> None:
        """Every dp rank starts from rank 0's draft (a fresh draft's init is per-process)."""
        if self.parallel.dp_size == 1:
            return
        assert self.model is not None
        params = list(self.model.parameters())
        flat = parameters_to_vector(params).detach().to(self.parallel._collective_device())
        dist.broadcast(flat, group=self.parallel.groups["dp"], group_src=0)
        with torch.no_grad():
            vector_to_parameters(flat.to(params[0].device), params)

    def _all_reduce_grads(self) -> None:
        """The draft is replicated: sum its gradients over dp in one flat buffer. Each rank's
        are dp x its partial (the training loop scales every loss by dp for FSDP2's average)."""
        dp = self.parallel.dp_size
        if dp == 1:
            return
        assert self.model is not None
        params = list(self.model.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.parallel._collective_device())
        self.parallel.all_reduce(flat, axis="dp").div_(dp)
        for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad = piece.view_as(p).to(p.device)

    # ------------------------------------------------------------------------------ training

    def _keep(self, key: str):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._capturing:
                out = output[0] if isinstance(output, tuple) else output
                self._captured[key] = out.detach()

        return hook

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Keep the policy's embeddings, aux hidden states and logits of each forward inside."""
        self._capturing = self.model is not None
        try:
            yield
        finally:
            self._capturing = False
            self._captured.clear()

    def begin_global_batch(self, batch: Any) -> None:
        """Count the global batch's real (t, t+1) pairs: the loss's normalizer."""
        if self.model is None:
            return
        lengths = batch["input_lengths"].to(torch.float32)
        pairs = ((lengths - 1).clamp(min=0) * batch["sample_mask"].to(torch.float32)).sum()
        dev = self.parallel._collective_device()
        self._pairs = max(float(self.parallel.all_reduce(pairs.reshape(1).to(dev), axis="dp")), 1.0)

    def microbatch_loss(self, mb: Any, metrics: dict[str, Any]) -> torch.Tensor | float:
        """`loss_weight` * this microbatch's share of the draft loss (0.0 when off); adds
        `draft_loss` and `draft_top1_agreement` (shares of the global batch's) to `metrics`."""
        if self.model is None or "logits" not in self._captured:
            return 0.0
        # A packed microbatch is one row of documents: unpack to one row per document, so the
        # draft's attention, its (t, t+1) shift and its positions stay inside each document.
        cap = {k: mb.unpack_rows(v) for k, v in self._captured.items()}
        aux = torch.cat([cap[f"aux{i}"] for i in self.aux_layers], dim=-1)[:, :-1]
        logits = self.model(aux.float(), cap["embeds"][:, 1:].float())
        teacher = cap["logits"][:, 1:].float()
        width = mb.width
        positions = torch.arange(1, width, device=logits.device)[None]
        real = positions < mb.lengths.to(logits.device)[:, None]
        if "sample_mask" in mb.data:
            real = real & (mb.data["sample_mask"].to(logits.device) != 0)[:, None]
        per_pair = -(torch.softmax(teacher, -1) * torch.log_softmax(logits, -1)).sum(-1)
        loss = (per_pair * real).sum() / self._pairs
        agree = ((logits.argmax(-1) == teacher.argmax(-1)) & real).sum() / self._pairs
        metrics["draft_loss"] = float(loss.detach())
        metrics["draft_top1_agreement"] = float(agree)
        self._captured.clear()
        return loss * self.cfg.loss_weight

    def finish_step(self, *, applied: bool) -> None:
        """Clip and step the draft's optimizer after an applied policy step; drop grads."""
        if self.optimizer is None:
            return
        if applied:
            limit = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
            assert self.model is not None  # an optimizer exists only with a draft
            self._all_reduce_grads()
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit)
            if bool(torch.isfinite(norm)):  # a non-finite draft gradient skips the draft's step
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------------------ state

    def checkpoint_folders(
        self, weights_path: str, optimizer_path: str | None
    ) -> dict[Path, StageFolder]:
        """The draft's folders in the policy's (asynchronous) save: `weights_path/draft/`
        (safetensors + config.json) and `optimizer_path/draft/`; none without a draft."""
        if self.model is None:
            return {}
        folders: dict[Path, StageFolder] = {Path(weights_path) / "draft": self._stage_weights}
        if optimizer_path is not None and self.optimizer is not None:
            folders[Path(optimizer_path) / "draft"] = self._stage_optimizer
        return folders

    def _stage_weights(self, folder: Path) -> Callable[[], None] | None:
        """Rank 0 copies the draft (replicated over dp) to the CPU now; the job writes it."""
        if self.model is None or self.parallel.rank != 0:
            return None
        from safetensors.torch import save_file

        state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        meta = eagle3_config(self.model, self.aux_layers)

        def write() -> None:
            folder.mkdir(parents=True, exist_ok=True)
            save_file(state, str(folder / _DRAFT_WEIGHTS))
            (folder / "config.json").write_text(json.dumps(meta, indent=1, default=str))

        return write

    def _stage_optimizer(self, folder: Path) -> Callable[[], None] | None:
        """Rank 0 copies the draft's optimizer state to the CPU now; the job writes it."""
        if self.optimizer is None or self.parallel.rank != 0:
            return None
        state = _cpu_copy(self.optimizer.state_dict())

        def write() -> None:
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(state, folder / _DRAFT_OPTIMIZER)

        return write

    def check_saved(self, weights_path: str | None, optimizer_path: str | None) -> None:
        """Refuse, before anything loads, a checkpoint whose draft folders are missing (while
        the draft is on, it would silently restart) or whose files differ from the save's
        digests."""
        if self.model is None or weights_path is None:
            return
        from policyworker.shell.checkpoint.digests import verify_digests

        folder = Path(weights_path) / "draft"
        if not (folder / _DRAFT_WEIGHTS).exists():
            msg = (
                f"policy.draft is enabled but the checkpoint {str(weights_path)!r} has no "
                f"draft/{_DRAFT_WEIGHTS}; load a checkpoint saved with the draft, or remove "
                f"policy.draft"
            )
            raise ValueError(msg)
        verify_digests(folder)
        if optimizer_path is not None and (Path(optimizer_path) / "draft").is_dir():
            verify_digests(Path(optimizer_path) / "draft")

    def load_beside(self, weights_path: str | None, optimizer_path: str | None) -> None:
        """Load the draft folders a checkpoint holds (`checkpoint_folders` wrote them)."""
        if self.model is None or weights_path is None:
            return
        self.check_saved(weights_path, optimizer_path)
        self.load(
            Path(weights_path) / "draft",
            None if optimizer_path is None else Path(optimizer_path) / "draft",
        )

    def load(self, folder: str | Path, optimizer_folder: str | Path | None) -> None:
        if self.model is None:
            return
        from safetensors.torch import load_file

        state = load_file(str(Path(folder) / _DRAFT_WEIGHTS))
        with torch.no_grad():
            self.model.load_state_dict(
                {k: v.to(self.model.fc.weight.device) for k, v in state.items()}
            )
        path = None if optimizer_folder is None else Path(optimizer_folder) / _DRAFT_OPTIMIZER
        if path is not None and path.exists() and self.optimizer is not None:
            self.optimizer.load_state_dict(torch.load(path, weights_only=True))


def _cpu_copy(obj: Any) -> Any:
    """A copy of an optimizer state dict with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    return obj


def _decoder_layers(policy: nn.Module) -> nn.ModuleList | None:
    base = getattr(policy, getattr(policy, "base_model_prefix", ""), None)
    return getattr(base, "layers", None)

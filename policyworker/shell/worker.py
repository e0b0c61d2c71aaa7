"""PolicyWorker: the stateful facade that trains an HF model and serves logprobs, top-k and scores.

Every method is collective (all ranks call it together) and is written for a data-parallel group
(global normalizers all-reduced over dp, loss x dp*cp before backward, dummy microbatches so
ranks stay in lockstep); on one process the collectives are identities.

Microbatching (fixed / dynamic / packed) is planned by `policyworker.functional.batching` on what
this rank receives; outputs come back in input row order. Padding positions (>= input_lengths)
never count: the worker masks `token_mask` by the lengths before the loss sees it.

Parallel layout (API.md §7 "Process group"): with a process group, `_parallelize` applies tensor
parallelism (tp > 1, vocab-parallel lm_head) and FSDP2 over dp (`shell.parallel`). Logprobs and
top-k then read vocab-sharded DTensor logits through `shell.collectives` (no vocab gather), the
grad norm is sharding-aware, and FSDP2 roots are resharded after every no-grad pass and before
any state read (`_reshard`). Weight refits gather on every rank; only rank 0 sends over ZMQ.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from policyworker.config import PolicyConfig, load_config, validate_for_world
from policyworker.data import BatchedDataDict, check_loss_fn, train_required_keys, validate_batch
from policyworker.functional import batching
from policyworker.functional.dtypes import precision_dtype
from policyworker.functional.logprobs import (
    count_and_zero_neg_inf,
    default_chunk_size,
    logprobs_with_leading_zero,
    sampling_filters_active,
)
from policyworker.functional.loss import LossInputType
from policyworker.functional.metrics import scale_microbatch_metrics
from policyworker.functional.packing import pack, packed_position_ids, unpack
from policyworker.functional.padding import mask_from_lengths
from policyworker.shell import collectives
from policyworker.shell import model as model_lib
from policyworker.shell import parallel as parallel_lib
from policyworker.shell.distributed import ParallelContext
from policyworker.shell.fusion import fuse_elementwise
from policyworker.shell.logs import apply_env_verbosity, quiet_progress_bars, startup_summary
from policyworker.shell.optim import build_optimizer, build_scheduler

__all__ = ["AutomodelPolicyWorker", "PolicyWorker"]

log = logging.getLogger(__name__)
_FP8_E4M3_MAX = 448.0
_INFERENCE_CHUNK_TOKENS = 2048


class _Microbatch:
    """One microbatch on the device: model inputs plus the data the loss reads ([b, w] tensors)."""

    def __init__(self, data: dict[str, Any], *, packed: bool, is_dummy: bool) -> None:
        self.data = data
        self.packed = packed
        self.is_dummy = is_dummy
        self.lengths = data["input_lengths"].to(torch.int64)
        self.width = data["input_ids"].shape[1]
        if packed:
            ids_N, self.cu_seqlens = pack(data["input_ids"], self.lengths)
            self.input_ids = ids_N[None]
            self.position_ids = packed_position_ids(self.lengths)[None]
            lengths = self.lengths
            self.max_seqlen = int(lengths.max()) if lengths.numel() else 0
        else:
            self.input_ids = data["input_ids"]
            self.position_ids = torch.arange(self.width, device=self.input_ids.device).expand(
                self.input_ids.shape[0], -1)
            self.cu_seqlens, self.max_seqlen = None, None

    def unpack_rows(self, x_1N: torch.Tensor) -> torch.Tensor:
        """Packed [1, N, ...] -> [b, w, ...] (identity for unpacked microbatches)."""
        if not self.packed:
            return x_1N
        return unpack(x_1N[0], self.cu_seqlens, seq_len=self.width, pad_value=0)


class PolicyWorker:
    """Trains a Hugging Face model with a pluggable loss; logprobs, top-k, scores, offload."""

    def __init__(
        self,
        config: PolicyConfig | Mapping[str, Any],
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        **kwargs: Any,
    ) -> None:
        apply_env_verbosity()
        self.cfg = config if isinstance(config, PolicyConfig) else load_config(config)
        dcfg = self.cfg.dtensor_cfg
        self.parallel: ParallelContext = kwargs.pop("parallel", None) or ParallelContext.from_environment(
            tp_size=dcfg.tensor_parallel_size, cp_size=dcfg.context_parallel_size)
        if kwargs:
            msg = f"unexpected PolicyWorker keyword arguments {sorted(kwargs)}; remove them"
            raise ValueError(msg)
        validate_for_world(self.cfg, dp_size=self.parallel.dp_size)
        if dcfg.cpu_offload and self.parallel.mesh is None:
            msg = ("dtensor_cfg.cpu_offload=True needs FSDP2, which needs a process group (this "
                   "is a single process without one); launch with torchrun (even "
                   "--nproc-per-node 1) or set cpu_offload: false")
            raise ValueError(msg)
        if dcfg.fusion != "none" and self.parallel.mesh is not None:
            msg = (f"dtensor_cfg.fusion={dcfg.fusion!r} compiles the single-process model; with a "
                   f"process group (world size {self.parallel.world_size}) FSDP2/TP own the layers, "
                   "so set fusion: none there")
            raise ValueError(msg)
        self.device = self.parallel.device
        self.dtype = precision_dtype(self.cfg.precision)
        weights_folder = _hf_weights_folder(weights_path)
        with quiet_progress_bars():
            self.model, self.tokenizer = model_lib.load_policy_model(
                self.cfg, device=self.device, weights_from=weights_folder)
        self.lora_module_names: list[str] = []
        if dcfg.lora_cfg is not None:
            from policyworker.shell.lora import apply_lora

            self.lora_module_names = apply_lora(self.model, dcfg.lora_cfg)
        self._parallelize()
        if self.cfg.sequence_packing is not None:
            model_lib.check_document_isolation(self.model, autocast_dtype=self.dtype)
            self._reshard()  # the probe's no-grad forward left FSDP2 roots unsharded
        self.fusion_report = fuse_elementwise(self.model, mode=dcfg.fusion, autocast_dtype=self.dtype)
        self.optimizer = build_optimizer(self.model, self.cfg.optimizer) if (
            init_optimizer and self.cfg.optimizer is not None) else None
        self.scheduler = build_scheduler(self.optimizer, self.cfg.scheduler) if self.optimizer else None
        gen = self.cfg.generation
        self._sampling = (gen.temperature, gen.top_k, gen.top_p) if gen is not None else (1.0, None, 1.0)
        self._reference_state = self._snapshot_state() if init_reference_model else None
        self._refit_sender: Any = None
        self._collective: Any = None
        self._sglang: Any = None
        if weights_path is not None or optimizer_path is not None:
            from policyworker.shell import checkpoint

            with quiet_progress_bars():
                checkpoint.load_checkpoint_at_init(self, weights_path, optimizer_path,
                                                   weights_loaded=weights_folder is not None)
        if self.parallel.rank == 0:
            log.info("%s", startup_summary(self))

    # ------------------------------------------------------------------------------ seams

    def _parallelize(self) -> None:
        """TP (tp > 1) then FSDP2 over dp when a process group exists; nothing for one process.

        LoRA adapters (already injected) follow their base layer's TP sharding and stay fp32
        under FSDP2 mixed precision (`parallelize_model` handles both).
        """
        if self.parallel.mesh is None:
            return
        dcfg = self.cfg.dtensor_cfg
        self.model = parallel_lib.parallelize_model(
            self.model, self.parallel, precision=self.dtype,
            activation_checkpointing=dcfg.activation_checkpointing,
            cpu_offload=dcfg.cpu_offload,
            sequence_parallel=dcfg.sequence_parallel and self.parallel.tp_size > 1)
        if dcfg.cpu_offload:
            parallel_lib.move_buffers(self.model, self.device)

    def _reshard(self) -> None:
        """Return FSDP2 parameters to their sharded DTensors (after a forward without backward,
        the root's stay unsharded and `parameters()` / `state_dict()` would yield those)."""
        if self.parallel.mesh is not None:
            parallel_lib.reshard(self.model)

    def _live_state(self) -> dict[str, torch.Tensor]:
        """Params + persistent buffers of the live model by state-dict name: this rank's local
        shards for DTensors (views: `copy_` into them writes the live parameters)."""
        self._reshard()
        out = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            out[k] = v.to_local() if isinstance(v, DTensor) else v
        return out

    # ------------------------------------------------------------------------------ helpers

    def _snapshot_state(self) -> dict[str, torch.Tensor]:
        pin = torch.cuda.is_available()
        out = {}
        for k, t in self._live_state().items():
            cpu = t.detach().to("cpu", copy=True)
            out[k] = cpu.pin_memory() if pin else cpu
        return out

    def _resolve_device(self, device: str | torch.device) -> torch.device:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            return self.device
        return device

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _release_memory(self) -> None:
        """Collect garbage and return cached accelerator blocks (nothing to return on CPU)."""
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def _validate(self, data: Mapping[str, Any], *, required=("input_ids", "input_lengths"),
                  skip=()) -> None:
        validate_batch(data, required=required, check_dim_skip_keys=tuple(skip or ()))
        for key in ("token_mask", "sample_mask"):
            if key in data and not isinstance(data[key], torch.Tensor):
                msg = f"data[{key!r}] must be a tensor, got {type(data[key]).__name__}"
                raise ValueError(msg)

    def _plans(self, lengths: torch.Tensor, *, seq_len: int, mbs: int, purpose: str
               ) -> list[batching.MicrobatchPlan]:
        """Fixed / dynamic / packed plans for this rank, plus dummies up to the all-rank max."""
        cfg = self.cfg
        if cfg.dynamic_batching is not None:
            dyn = cfg.dynamic_batching
            budget = dyn.train_mb_tokens if purpose == "train" else dyn.logprob_tokens
            plans = batching.dynamic_microbatches(lengths, max_tokens=budget, seq_len=seq_len,
                                                  sequence_length_round=dyn.sequence_length_round)
        elif cfg.sequence_packing is not None:
            sp = cfg.sequence_packing
            budget = sp.train_mb_tokens if purpose == "train" else sp.logprob_tokens
            plans = batching.packed_microbatches(
                lengths, capacity=budget, algorithm=sp.algorithm,
                pad_multiple=cfg.make_sequence_length_divisible_by)
        else:
            plans = batching.fixed_microbatches(int(lengths.shape[0]), mbs, seq_len=seq_len)
        max_count = self.parallel.all_reduce_int(len(plans), op="max", axis="world")
        return plans + batching.dummy_microbatches(
            plans, batching.num_dummy_microbatches(len(plans), max_count))

    def _microbatch(self, data: Mapping[str, Any], plan: batching.MicrobatchPlan, *,
                    skip=()) -> _Microbatch:
        rows = list(plan.rows)
        lengths = data["input_lengths"][rows]
        width = int(lengths.max()) if plan.packed and rows else plan.width
        width = max(width, 1)
        index = torch.tensor(rows, dtype=torch.int64)
        out: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                t = value.index_select(0, index.to(value.device))
                if t.ndim >= 2 and key not in skip:
                    t = t[:, :width]
                out[key] = t.to(self.device, non_blocking=True)
            else:
                out[key] = [value[i] for i in rows]
        return _Microbatch(out, packed=plan.packed, is_dummy=plan.is_dummy)

    def _forward(self, mb: _Microbatch) -> torch.Tensor:
        return model_lib.forward_logits(
            self.model, mb.input_ids, position_ids=mb.position_ids, autocast_dtype=self.dtype,
            cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)

    def _next_token_logprobs(self, mb: _Microbatch, logits: torch.Tensor, *, filtered: bool
                             ) -> torch.Tensor:
        """[b, w-1] next-token logprobs of microbatch `mb` from its logits (differentiable)."""
        temperature, top_k, top_p = self._sampling_for(filtered)
        chunk = self.cfg.logprob_chunk_size or default_chunk_size(logits.shape[-1])
        lp = self._logprobs_any(logits, mb.input_ids, temperature=temperature, top_k=top_k,
                                top_p=top_p, chunk_size=chunk)
        return self._rows_of_next(mb, lp)

    def _logprobs_any(self, logits: torch.Tensor, ids: torch.Tensor, *, temperature: float,
                      top_k: int | None, top_p: float, chunk_size: int) -> torch.Tensor:
        """Next-token logprobs of plain or vocab-sharded (TP) logits.

        Top-k/top-p under TP move whole rows between ranks, which needs `rows * positions`
        divisible by tp; otherwise this block's logits are gathered over the vocab first (one
        [rows, positions, V] block, differentiable) and scored as plain logits.
        """
        if (isinstance(logits, DTensor) and sampling_filters_active(top_k, top_p)
                and ids.numel() % self.parallel.tp_size != 0):
            logits = logits.full_tensor()
        return collectives.next_token_logprobs_any(
            logits, ids, self.parallel, temperature=temperature, top_k=top_k, top_p=top_p,
            chunk_size=chunk_size)

    def _sampling_for(self, filtered: bool) -> tuple[float, int | None, float]:
        temperature, top_k, top_p = self._sampling
        return (temperature, top_k, top_p) if filtered else (temperature, None, 1.0)

    @staticmethod
    def _rows_of_next(mb: _Microbatch, lp: torch.Tensor) -> torch.Tensor:
        """Model-row next-token values [b or 1, T-1] -> [b, w-1] per sequence."""
        if not mb.packed:
            return lp
        full_1N = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
        return mb.unpack_rows(full_1N)[:, 1:]

    def _logit_chunks(self, mb: _Microbatch):
        """(logits_at(start, stop), num_positions, vocab) for no-grad inference.

        For plain causal LMs only the hidden states are kept and the LM head runs one chunk of
        positions at a time, so no [T, V] logits tensor exists; other heads use full logits, and
        so does sequence parallelism (its hidden states are sharded on the sequence). Under TP
        each chunk's logits are a vocab-sharded DTensor.
        """
        sequence_sharded = self.cfg.dtensor_cfg.sequence_parallel and self.parallel.tp_size > 1
        if model_lib.supports_chunked_lm_head(self.model) and not sequence_sharded:
            hidden = self._hidden_states(mb)
            head = self.model.get_output_embeddings()

            def logits_at(start: int, stop: int) -> torch.Tensor:
                with model_lib.autocast_context(self.device, self.dtype):
                    return head(hidden[:, start:stop])

            return logits_at, hidden.shape[1], int(head.weight.shape[0])
        logits = self._forward(mb)
        return (lambda start, stop: logits[:, start:stop]), logits.shape[1], logits.shape[-1]

    def _hidden_states(self, mb: _Microbatch) -> torch.Tensor:
        """Last hidden states [b, T, H] (no grad); FSDP2 runs them through the root module, whose
        parameters (embeddings, final norm, head) then stay unsharded until `_reshard`."""
        return model_lib.forward_hidden(
            self.model, mb.input_ids, position_ids=mb.position_ids, autocast_dtype=self.dtype,
            cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen,
            through_root=self.parallel.mesh is not None)

    def _inference_chunk(self, vocab: int, *, rows: int) -> int:
        """Positions per LM-head chunk: `logprob_chunk_size`, else about 2048 tokens per chunk
        (big enough for an efficient head GEMM, at most ~14 bytes * 2048 * V of scratch)."""
        if self.cfg.logprob_chunk_size:
            return self.cfg.logprob_chunk_size
        return max(default_chunk_size(vocab), -(-_INFERENCE_CHUNK_TOKENS // max(rows, 1)))

    def _inference_next_token_logprobs(self, mb: _Microbatch) -> torch.Tensor:
        """[b, w-1] filtered next-token logprobs, chunk by chunk over positions (no grad)."""
        logits_at, num_positions, vocab = self._logit_chunks(mb)
        temperature, top_k, top_p = self._sampling_for(True)
        chunk = self._inference_chunk(vocab, rows=mb.input_ids.shape[0])
        parts = [torch.zeros(mb.input_ids.shape[0], 0, device=self.device)]
        for start in range(0, num_positions - 1, chunk):
            stop = min(start + chunk, num_positions - 1)
            parts.append(self._logprobs_any(
                logits_at(start, stop + 1), mb.input_ids[:, start:stop + 1],
                temperature=temperature, top_k=top_k, top_p=top_p, chunk_size=chunk))
        return self._rows_of_next(mb, torch.cat(parts, dim=1))

    def _filtering(self) -> bool:
        _, top_k, top_p = self._sampling
        return sampling_filters_active(top_k, top_p)

    @staticmethod
    def _valid_mask(data: Mapping[str, Any], seq_len: int) -> torch.Tensor:
        lengths = data["input_lengths"]
        valid = mask_from_lengths(lengths.to(torch.int64), seq_len).to(lengths.device)
        if "token_mask" in data:
            valid = valid & (data["token_mask"].to(valid.device) != 0)
        if "sample_mask" in data:
            valid = valid & (data["sample_mask"].to(valid.device) != 0)[:, None]
        return valid

    # ------------------------------------------------------------------------------ train

    def train(self, data: Mapping[str, Any], loss_fn: Any, eval_mode: bool = False,
              gbs: int | None = None, mbs: int | None = None,
              check_dim_skip_keys: Any = None) -> dict[str, Any]:
        """Train on every whole global batch of `data` (one optimizer step per global batch)."""
        skip = tuple(check_dim_skip_keys or ())
        check_loss_fn(loss_fn)
        validate_batch(data, required=train_required_keys(loss_fn), check_dim_skip_keys=skip,
                       needed_by=f"train() with {type(loss_fn).__name__}")
        self._validate(data, skip=skip)
        if not eval_mode and self.optimizer is None:
            msg = "train() needs an optimizer but the worker was built with init_optimizer=False"
            raise ValueError(msg)
        if (not eval_mode and self.device.type == "cpu"
                and self.model.config._attn_implementation == "flex_attention"):
            msg = ("attn_implementation 'flex_attention' has no backward on CPU; use 'auto' or "
                   "'sdpa' for training on CPU (flex_attention works for inference)")
            raise ValueError(msg)
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        dp, cp = self.parallel.dp_size, self.parallel.cp_size
        if gbs % dp != 0:
            msg = f"gbs={gbs} must be a multiple of the data-parallel size {dp}"
            raise ValueError(msg)
        local_gbs = gbs // dp
        size = int(data["input_ids"].shape[0])
        total = self.parallel.all_reduce_int(size, axis="dp")
        num_gb = total // gbs
        if num_gb == 0:
            msg = (f"the batch has {total} rows over all data-parallel ranks, fewer than one "
                   f"global batch (gbs={gbs}); pass at least gbs rows or a smaller gbs")
            raise ValueError(msg)
        self.model.train(not eval_mode)
        grad_ctx = torch.no_grad() if eval_mode else contextlib.nullcontext()
        losses, all_mb_metrics = [], {}
        grad_norm, skipped, stepped = None, 0, 0
        with grad_ctx:
            for g in range(num_gb):
                rows = slice(g * local_gbs, (g + 1) * local_gbs)
                batch = {k: v[rows] for k, v in data.items()}
                out = self._train_global_batch(batch, loss_fn, eval_mode=eval_mode, mbs=mbs,
                                               num_gb=num_gb, skip=skip, dp_cp=dp * cp)
                mb_losses, mb_metrics, grad_norm, was_skipped = out
                skipped += int(was_skipped)
                stepped += int(not eval_mode and not was_skipped)
                losses.append(math.fsum(mb_losses))
                for m in mb_metrics:
                    for k, v in m.items():
                        all_mb_metrics.setdefault(k, []).append(v)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if stepped and self.scheduler is not None:
            self.scheduler.step()
        self._empty_cache()
        global_loss = self.parallel.all_reduce(
            torch.tensor(losses, dtype=torch.float32, device=self.parallel._collective_device()),
            axis="dp").cpu()
        return {"global_loss": global_loss, "grad_norm": grad_norm,
                "all_mb_metrics": all_mb_metrics, "rank": self.parallel.rank,
                "model_dtype": self.dtype, "skipped_steps": skipped}

    def _global_normalizers(self, batch: Mapping[str, Any], loss_fn: Any
                            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        seq_len = batch["input_ids"].shape[1]
        lengths = batch["input_lengths"].to(torch.int64)
        sample_mask = batch["sample_mask"].to(torch.float32)
        batch = dict(batch)
        if "token_mask" in batch:
            token_mask = batch["token_mask"]
            in_len = mask_from_lengths(lengths, seq_len).to(token_mask.device)
            batch["token_mask"] = torch.where(in_len, token_mask, torch.zeros_like(token_mask))
            toks = (batch["token_mask"][:, 1:].to(torch.float32) * sample_mask[:, None]).sum()
        else:
            toks = sample_mask.sum() * seq_len
        dev = self.parallel._collective_device()
        gvs = self.parallel.all_reduce(sample_mask.sum().reshape(()).to(dev), axis="dp")
        gvt = self.parallel.all_reduce(toks.reshape(()).to(dev), axis="dp")
        return gvs.to(self.device), gvt.to(self.device), batch

    def _train_global_batch(self, batch, loss_fn, *, eval_mode, mbs, num_gb, skip, dp_cp):
        gvs, gvt, batch = self._global_normalizers(batch, loss_fn)
        plans = self._plans(batch["input_lengths"], seq_len=batch["input_ids"].shape[1], mbs=mbs,
                            purpose="train")
        if not eval_mode:
            self.optimizer.zero_grad(set_to_none=True)
        mb_losses, mb_metrics, finite = [], [], True
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else 0.0
        for plan in plans:
            mb = self._microbatch(batch, plan, skip=skip)
            loss, metrics = self._loss(mb, loss_fn, gvs, gvt)
            if mb.is_dummy:
                loss = loss * 0
            if not eval_mode:
                (loss * dp_cp).backward()
            if mb.is_dummy:
                continue
            finite = finite and bool(torch.isfinite(loss.detach()).item())
            metrics = scale_microbatch_metrics(metrics, num_gb)
            metrics.update(lr=lr, global_valid_seqs=float(gvs), global_valid_toks=float(gvt))
            if metrics["num_valid_samples"] > 0:
                mb_losses.append(float(loss.detach().item()))
                mb_metrics.append(metrics)
        if eval_mode:
            return mb_losses, mb_metrics, None, False
        grad_norm, skipped = self._optimizer_step(finite)
        for i, m in enumerate(mb_metrics):
            m["skipped_step"] = float(skipped and i == 0)
        return mb_losses, mb_metrics, grad_norm, skipped

    def _loss(self, mb: _Microbatch, loss_fn, gvs, gvt):
        logits = self._forward(mb)
        if loss_fn.input_type == LossInputType.LOGIT:
            if isinstance(logits, DTensor):
                # A LOGIT loss may do anything with the vocab dim: give it the full logits. The
                # gather is differentiable (each TP rank gets its vocab shard's gradient back).
                logits = logits.full_tensor()
            logits = mb.unpack_rows(logits)
            if self._sampling[0] != 1.0:
                logits = logits / self._sampling[0]
            return loss_fn(mb.data, gvs, gvt, logits=logits)
        data = dict(mb.data)
        lp = self._next_token_logprobs(mb, logits, filtered=True)
        if self._filtering():
            valid = self._valid_mask(data, mb.width)[:, 1:]
            lp, _ = count_and_zero_neg_inf(lp, valid)
            if getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0:
                data["curr_logprobs_unfiltered"] = self._next_token_logprobs(
                    mb, logits, filtered=False)
        return loss_fn(data, gvs, gvt, next_token_logprobs=lp)

    def _total_grad_norm(self) -> torch.Tensor:
        """Pre-clip global L2 norm of all grads (sharded grads reduced over their mesh dims)."""
        return collectives.total_grad_norm(self.model.parameters(), self.parallel)

    def _optimizer_step(self, loss_finite: bool) -> tuple[float, bool]:
        total_norm = self._total_grad_norm()
        bad = int(not loss_finite or not bool(torch.isfinite(total_norm).item()))
        bad = self.parallel.all_reduce_int(bad, op="max", axis="world")
        grad_norm = float(total_norm.item())
        if bad:
            warnings.warn(f"non-finite loss or grad norm ({grad_norm}); the optimizer step was "
                          f"skipped (weights and optimizer state unchanged)", stacklevel=3)
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, True
        if self.cfg.max_grad_norm is not None:
            params = [p for p in self.model.parameters() if p.grad is not None]
            collectives.clip_grads_(params, self.cfg.max_grad_norm, total_norm)
        self.optimizer.step()
        if hasattr(self.model, "update_moe_gate_bias"):
            self.model.update_moe_gate_bias()
        return grad_norm, False

    # ------------------------------------------------------------------------------ inference

    def _inference_plans(self, data, micro_batch_size):
        mbs = micro_batch_size or self.cfg.logprob_batch_size
        return self._plans(data["input_lengths"], seq_len=data["input_ids"].shape[1], mbs=mbs,
                           purpose="logprob")

    def _run_inference(self, data, micro_batch_size, per_microbatch) -> Any:
        """Run `per_microbatch(mb) -> [b, w, ...]` (or a tuple of such) over all plans.

        Returns [B, S, ...] CPU tensors (a tuple when `per_microbatch` returns one), in input order.
        """
        seq_len = data["input_ids"].shape[1]
        plans = self._inference_plans(data, micro_batch_size)
        self.model.eval()
        outputs: list[tuple[torch.Tensor, ...]] = []
        try:
            with torch.no_grad():
                for plan in plans:
                    mb = self._microbatch(data, plan)
                    out = per_microbatch(mb)
                    if mb.is_dummy:
                        continue
                    outs = out if isinstance(out, tuple) else (out,)
                    outputs.append(tuple(_pad_seq(o, seq_len).cpu() for o in outs))
        finally:
            self._reshard()
        if not outputs:
            raise ValueError("the batch has no rows; pass at least one row")
        order = batching.rows_in_input_order(plans)
        result = tuple(torch.cat(parts)[order] for parts in zip(*outputs, strict=True))
        return result if len(result) > 1 else result[0]

    def get_logprobs(self, data: Mapping[str, Any], micro_batch_size: int | None = None,
                     require_router_replay: bool = True) -> BatchedDataDict:
        """fp32 [B, S] logprobs: 0 at column 0 and at positions >= input_lengths (API §4)."""
        self._validate(data)
        self._check_router_replay(data, require_router_replay)
        counts = [0]

        def per_mb(mb: _Microbatch) -> torch.Tensor:
            lp = logprobs_with_leading_zero(
                self._inference_next_token_logprobs(mb), mb.lengths)
            if self._filtering() and not mb.is_dummy:
                lp, num_neg_inf = count_and_zero_neg_inf(lp, self._valid_mask(mb.data, mb.width))
                counts[0] += num_neg_inf
            return lp

        logprobs = self._run_inference(data, micro_batch_size, per_mb)
        if counts[0]:
            warnings.warn(f"policy top-k/top-p mismatch: {counts[0]} valid token(s) had -inf "
                          f"logprob under the sampling filters; they were set to 0", stacklevel=2)
        return BatchedDataDict(logprobs=logprobs.float())

    def _check_router_replay(self, data: Mapping[str, Any], require: bool) -> None:
        if self.cfg.router_replay is None or not require:
            return
        if "routed_experts" not in data:
            msg = ("router_replay is enabled and require_router_replay=True but data has no "
                   "'routed_experts' [B, S, L, topk]; add it or pass require_router_replay=False")
            raise ValueError(msg)
        msg = (f"router replay is not supported for model_type "
               f"{self.model.config.model_type!r} by this worker; disable router_replay or pass "
               f"require_router_replay=False")
        raise ValueError(msg)

    def get_reference_policy_logprobs(self, data: Mapping[str, Any],
                                      micro_batch_size: int | None = None) -> BatchedDataDict:
        """Logprobs of the reference weights (filters off, temperature kept)."""
        with self.use_reference_model():
            out = self.get_logprobs(data, micro_batch_size, require_router_replay=False)
        return BatchedDataDict(reference_logprobs=out["logprobs"])

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        """Swap the reference weights in place; restore the policy weights even on error."""
        if self._reference_state is None:
            msg = ("use_reference_model() needs reference weights but the worker was built with "
                   "init_reference_model=False")
            raise ValueError(msg)
        live = self._live_state()
        saved = self._snapshot_state()
        sampling = self._sampling
        try:
            with torch.no_grad():
                for k, t in live.items():
                    t.copy_(self._reference_state[k])
            self._sampling = (sampling[0], None, 1.0)
            with torch.no_grad():
                yield
        finally:
            self._sampling = sampling
            with torch.no_grad():
                for k, t in live.items():
                    t.copy_(saved[k])

    def get_topk_logits(self, data: Mapping[str, Any], k: int, micro_batch_size: int | None = None
                        ) -> BatchedDataDict:
        """Top-k of temperature-scaled logits at every position (no shift), 0/0 at padding."""
        self._validate(data)
        if not isinstance(k, int) or k < 1:
            msg = f"k={k!r} must be a positive int"
            raise ValueError(msg)
        temperature = self._sampling[0]

        def per_mb(mb: _Microbatch) -> torch.Tensor:
            logits_at, num_positions, vocab = self._logit_chunks(mb)
            k_eff = min(k, vocab)
            chunk = self._inference_chunk(vocab, rows=mb.input_ids.shape[0])
            vals, idx = [], []
            for s in range(0, num_positions, chunk):
                # Exact fp32 top-k of logits / T (ties -> lower id); vocab shards under TP.
                v, i = collectives.topk_any(logits_at(s, s + chunk), k_eff,
                                            temperature=temperature)
                vals.append(v)
                idx.append(i)
            v, i = mb.unpack_rows(torch.cat(vals, 1)), mb.unpack_rows(torch.cat(idx, 1))
            valid = mask_from_lengths(mb.lengths, mb.width)[..., None].to(v.device)
            return (torch.where(valid, v, torch.zeros_like(v)),
                    torch.where(valid, i, torch.zeros_like(i)))

        values, indices = self._run_inference(data, micro_batch_size, per_mb)
        return BatchedDataDict(topk_logits=values.float(), topk_indices=indices.to(torch.int64))

    def score(self, data: Mapping[str, Any]) -> BatchedDataDict:
        """Reward scores: [B] (bradley_terry, at the last token) or [B, S] (regression)."""
        kind = model_lib.reward_model_type(self.cfg)
        if kind is None:
            msg = "score() needs a reward model; set reward_model_cfg in the config"
            raise ValueError(msg)
        self._validate(data)
        mbs = self.cfg.batch_size or self.cfg.logprob_batch_size

        def per_mb(mb: _Microbatch) -> torch.Tensor:
            hidden = self._hidden_states(mb)
            with model_lib.autocast_context(self.device, self.dtype):
                scores = self.model.score(hidden)[..., 0].float()
            valid = mask_from_lengths(mb.lengths, mb.width).to(scores.device)
            return torch.where(valid, scores, torch.zeros_like(scores))

        scores = self._run_inference(data, mbs, per_mb)
        if kind == "bradley_terry":
            lengths = data["input_lengths"].to(torch.int64).cpu()
            last = (lengths - 1).clamp(min=0)
            scores = torch.where(lengths > 0, scores.gather(1, last[:, None])[:, 0],
                                 torch.zeros(lengths.shape))
        return BatchedDataDict(scores=scores.float())

    def calibrate_qkv_fp8_scales(self, data: Mapping[str, Any], micro_batch_size: int | None = None,
                                 percentile: float = 99.9, margin: float = 1.05,
                                 include_q: bool = False) -> dict[str, Any]:
        """Per-attention-layer FP8 (e4m3) scales: percentile(|k|, |v|[, |q|]) * margin / 448."""
        self._validate(data)
        if not 0.0 < percentile <= 100.0 or margin <= 0:
            msg = f"percentile={percentile} must be in (0, 100] and margin={margin} > 0"
            raise ValueError(msg)
        projs = ("q_proj", "k_proj", "v_proj") if include_q else ("k_proj", "v_proj")
        samples: dict[tuple[str, str], list[torch.Tensor]] = {}
        current: dict[str, torch.Tensor] = {}
        handles = []
        for name, module in self.model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in projs:
                def hook(_m, _inp, out, key=(name.rsplit(".", 1)[0], leaf[0])):
                    valid = current["valid"].reshape(-1)
                    flat = out.detach().float().reshape(valid.shape[0], -1)[valid]
                    samples.setdefault(key, []).append(flat.abs().reshape(-1).cpu())
                handles.append(module.register_forward_hook(hook))
        if not handles:
            msg = (f"model_type {self.model.config.model_type!r} has no q_proj/k_proj/v_proj "
                   f"modules to calibrate")
            raise ValueError(msg)

        def per_mb(mb: _Microbatch) -> torch.Tensor:
            valid = mask_from_lengths(mb.lengths, mb.width).to(self.device)
            current["valid"] = torch.ones_like(mb.input_ids, dtype=torch.bool) if mb.packed else valid
            self._forward(mb)
            return valid.float()

        try:
            self._run_inference(data, micro_batch_size, per_mb)
        finally:
            for h in handles:
                h.remove()
        gathered = self._gather_samples({key: torch.cat(parts) for key, parts in samples.items()})
        layers: dict[str, dict[str, float]] = {}
        for (layer, kind), values in sorted(gathered.items()):
            rank = max(1, math.ceil(percentile / 100.0 * values.numel()))
            amax = float(values.kthvalue(rank).values) if values.numel() else 0.0
            layers.setdefault(layer, {})[f"{kind}_scale"] = max(amax, 1e-12) * margin / _FP8_E4M3_MAX
        kv_scales = {f"{layer}.{key}": v for layer, d in layers.items() for key, v in d.items()}
        return {"format": "fp8_e4m3", "percentile": percentile, "margin": margin,
                "layers": layers, "kv_scales": kv_scales}

    def _gather_samples(self, local: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
        """Concatenate every rank's samples per key (dp ranks hold other rows, TP ranks other
        heads), so the percentile is the single-process one and identical on every rank."""
        if self.parallel.world_size == 1:
            return local
        everyone: list[Any] = [None] * self.parallel.world_size
        dist.all_gather_object(everyone, local, group=self.parallel.groups["world"])
        return {key: torch.cat([part[key] for part in everyone if key in part])
                for key in sorted({k for part in everyone for k in part})}

    # ------------------------------------------------------------------------------ offload

    def move_buffer_to_device(self, model: torch.nn.Module, device: str | torch.device
                              ) -> torch.nn.Module:
        parallel_lib.move_buffers(model, self._resolve_device(device))
        return model

    def move_to_device(self, model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
        device = self._resolve_device(device)
        self.move_buffer_to_device(model, device)
        return model.to(device)

    def move_to_cuda(self, model: torch.nn.Module) -> torch.nn.Module:
        model = self.move_to_device(model, self.device)
        self._empty_cache()
        return model

    def move_to_cpu(self, model: torch.nn.Module) -> torch.nn.Module:
        model = self.move_to_device(model, "cpu")
        self._release_memory()
        return model

    def move_optimizer_to_device(self, device: str | torch.device) -> None:
        if self.optimizer is None:
            return
        device = self._resolve_device(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != device:
                    state[key] = value.to(device)

    def _fsdp_offloaded(self) -> bool:
        """FSDP2 CPU offload: parameters live on the CPU for good and FSDP2 streams them."""
        return self.cfg.dtensor_cfg.cpu_offload and self.parallel.mesh is not None

    def prepare_for_training(self) -> None:
        if self._fsdp_offloaded():  # buffers only; the optimizer stays with its CPU params
            self.move_buffer_to_device(self.model, self.device)
        else:
            self.move_to_cuda(self.model)
            self.move_optimizer_to_device(self.device)
        self.model.train()
        self._empty_cache()

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        if self._fsdp_offloaded():
            self.move_buffer_to_device(self.model, self.device)
        else:
            self.move_to_cuda(self.model)
        self.model.eval()
        if not keep_train_buffers and self.optimizer is not None and (
                self.cfg.offload_optimizer_for_logprob):
            self.move_optimizer_to_device("cpu")
        self._release_memory()

    def finish_inference(self) -> None:
        self.move_to_cpu(self.model)
        self.model.eval()

    def finish_training(self) -> None:
        """Nothing to release (grads are freed at the end of every train() call)."""

    def offload_before_refit(self) -> None:
        if self.optimizer is not None:
            self.move_optimizer_to_device("cpu")
        self._release_memory()

    def offload_after_refit(self) -> None:
        self.move_to_cpu(self.model)
        self.model.eval()
        self.offload_before_refit()
        if self.device.type == "cuda":
            log.info("after offload_after_refit: %.3f GiB allocated, %.3f GiB reserved",
                     torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30)

    # ------------------------------------------------------------------------------ refit

    def _sender(self) -> Any:
        if self._refit_sender is None:
            from policyworker.shell.refit import RefitSender

            self._refit_sender = RefitSender(lambda: self.model, self.dtype, rank=self.parallel.rank,
                                             device=self.device)
        return self._refit_sender

    def prepare_refit_info(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """{hf_name: (shape, dtype)} in send order (the dtypes every refit sends); global
        (unsharded) shapes on every rank."""
        self._reshard()
        return self._sender().prepare_refit_info()

    def get_zmq_address(self) -> str:
        """The address rank 0's receiver connects to (every rank has one; only rank 0 sends)."""
        return self._sender().get_zmq_address()

    def stream_weights_via_ipc_zmq(self, buffer_size_bytes: int = 0, kv_scales: Any = None, *,
                                   timeout_s: float = 120.0) -> dict[str, Any] | None:
        """One colocated refit over ZMQ + CUDA IPC (shared memory on CPU); the receiver's report.

        Under a process group every rank calls it: all ranks gather the sharded weights together
        (one tensor at a time) and rank 0 streams the full tensors to its receiver; other ranks
        return None. If rank 0's stream fails it still finishes the gathers, so the others are
        released, and every rank raises (rank 0 with the transport's error).
        """
        from policyworker.shell.refit import check_stream_args

        self._reshard()
        if self.parallel.world_size == 1:
            return self._sender().stream_weights_via_ipc_zmq(buffer_size_bytes, kv_scales,
                                                             timeout_s=timeout_s)
        check_stream_args(buffer_size_bytes, kv_scales, timeout_s)
        from policyworker.shell.params import refit_stream

        gathers: list[_Draining] = []

        def drainable(sources: Iterator[Any]) -> _Draining:
            gathers.append(_Draining(sources))
            return gathers[-1]

        report, failed = None, 0
        try:
            if self.parallel.rank == 0:
                report = self._sender().stream_weights_via_ipc_zmq(
                    buffer_size_bytes, kv_scales, timeout_s=timeout_s, wrap_sources=drainable)
            else:
                drainable(refit_stream(self.model, self.dtype).sources)
        except BaseException:
            failed = 1
            with contextlib.suppress(Exception):  # release the peers' gathers, keep our error
                for sources in gathers:
                    sources.drain()
                self.parallel.all_reduce_int(failed, op="max", axis="world")
            raise
        for sources in gathers:
            sources.drain()
        if self.parallel.all_reduce_int(failed, op="max", axis="world"):
            from policyworker.errors import RefitError

            msg = (f"refit over ZMQ failed on rank 0 (rank {self.parallel.rank} took part in the "
                   f"weight gathers only); see rank 0's error, then call "
                   f"stream_weights_via_ipc_zmq again on every rank")
            raise RefitError(msg)
        return report

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> None:
        from policyworker.shell.transports.collective import init_collective

        self._collective = init_collective(ip, port, world_size, train_world_size=train_world_size,
                                           rank=self.parallel.rank, device=self.device)

    def broadcast_weights_for_collective(self, kv_scales: Any = None, refit_timeout_s: float | None = None,
                                         *, buffer_size_bytes: int | None = None,
                                         num_buffers: int | None = None,
                                         use_legacy_packing: bool = False) -> dict[str, Any]:
        from policyworker.shell.transports.collective import broadcast_model_weights

        self._reshard()
        return broadcast_model_weights(
            self._collective, self.model, self.dtype, kv_scales=kv_scales,
            refit_timeout_s=refit_timeout_s, buffer_size_bytes=buffer_size_bytes,
            num_buffers=num_buffers, use_legacy_packing=use_legacy_packing)

    def _sglang_sender(self) -> Any:
        if self._sglang is None:
            from policyworker.shell.transports.sglang import SGLangColocatedSender

            self._sglang = SGLangColocatedSender(rank=self.parallel.rank,
                                                 world_size=self.parallel.world_size)
        return self._sglang

    def set_rollout_num_gpus_per_engine(self, num_gpus_per_engine: int) -> None:
        self._sglang_sender().set_rollout_num_gpus_per_engine(num_gpus_per_engine)

    def update_weights_to_sglang_colocated(self, *, rollout_engines: Any, buffer_size_bytes: int,
                                           target_precision: str = "bf16",
                                           sglang_quantization_cfg: Any = None) -> Any:
        from policyworker.shell.params import params_generator

        self._reshard()
        named = params_generator(self.model, precision_dtype(target_precision))
        return self._sglang_sender().update_weights(
            named, rollout_engines=rollout_engines, buffer_size_bytes=buffer_size_bytes,
            target_precision=target_precision, sglang_quantization_cfg=sglang_quantization_cfg)

    def get_full_logits_ipc(self, data: Mapping[str, Any], micro_batch_size: int | None = None
                            ) -> dict[str, Any]:
        from policyworker.shell.transports.ipc_logits import full_logits_ipc

        try:
            return full_logits_ipc(self, data, micro_batch_size)
        finally:
            self._reshard()

    def release_ipc_buffer(self) -> None:
        from policyworker.shell.transports.ipc_logits import release_ipc_buffer

        release_ipc_buffer(self)

    # ------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None,
                        tokenizer_path: str | None = None, *, is_final_checkpoint: bool = False
                        ) -> None:
        from policyworker.shell import checkpoint

        with quiet_progress_bars():
            checkpoint.save_checkpoint(self, weights_path, optimizer_path, tokenizer_path,
                                       is_final_checkpoint=is_final_checkpoint)

    def finalize_async_save(self) -> None:
        from policyworker.shell import checkpoint

        with quiet_progress_bars():
            checkpoint.finalize_async_save(self)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        from policyworker.shell import checkpoint

        with quiet_progress_bars():
            checkpoint.load_checkpoint(self, weights_path, optimizer_path)

    # ------------------------------------------------------------------------------ misc

    def return_state_dict(self) -> dict[str, torch.Tensor]:
        """The live state dict: sharded DTensors under FSDP2 / TP (`.full_tensor()` gathers)."""
        self._reshard()
        return self.model.state_dict()

    def return_model_config(self) -> Any:
        return self.model.config

    def _add_noise_to_weights(self) -> None:
        """N(0, 0.01^2) noise on trainable weights; the same full noise tensor on every rank
        (a generator seeded alike), so replicas stay equal and shards stay consistent."""
        self._reshard()
        seed = int(torch.randint(0, 2**30, ())) if self.parallel.rank == 0 else 0
        gen = torch.Generator().manual_seed(self.parallel.all_reduce_int(seed, axis="world"))
        with torch.no_grad():
            for p in self.model.parameters():
                if not p.requires_grad:
                    continue
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.01
                if isinstance(p, DTensor):
                    from torch.distributed.tensor import distribute_tensor

                    noise = distribute_tensor(noise.to(p.device, p.dtype), p.device_mesh,
                                              p.placements, src_data_rank=None)
                p.add_(noise.to(p.device, p.dtype))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def is_alive(self) -> bool:
        return True

    def __repr__(self) -> str:
        p = self.parallel
        return (f"{type(self).__name__}(model={self.cfg.model_name!r}, "
                f"precision={str(self.dtype).removeprefix('torch.')}, device={self.device}, "
                f"dp×cp×tp={p.dp_size}×{p.cp_size}×{p.tp_size}, rank={p.rank}/{p.world_size}, "
                f"attention={getattr(self.model.config, '_attn_implementation', '?')!r})")

    def shutdown(self) -> bool:
        if self._refit_sender is not None:
            self._refit_sender.close()
            self._refit_sender = None
        self.parallel.shutdown()
        return True


class _Draining:
    """An iterator that can be run to its end later (`drain`), so every rank of a sharded
    model finishes the same sequence of weight gathers even when the consumer stopped early."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it

    def __iter__(self) -> _Draining:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def drain(self) -> None:
        for _ in self._it:
            pass


def _pad_seq(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Right-pad dim 1 of `x` with zeros to `seq_len`."""
    if x.ndim < 2 or x.shape[1] >= seq_len:
        return x
    return torch.nn.functional.pad(x, (0, 0) * (x.ndim - 2) + (0, seq_len - x.shape[1]))


def _hf_weights_folder(weights_path: str | None) -> str | None:
    """The HF folder to build the model from when `weights_path` holds safetensors weights."""
    if weights_path is None:
        return None
    from policyworker.shell import checkpoint

    if checkpoint.detect_weights_format(weights_path) != "safetensors":
        return None  # DCP / PEFT: built from model_name, then loaded by the checkpoint module
    return str(checkpoint._model_folder(weights_path))


AutomodelPolicyWorker = PolicyWorker

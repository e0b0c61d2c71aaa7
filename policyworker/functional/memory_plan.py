"""Predicted peak device bytes of each phase of one policy worker, from plain shape numbers.

A phase is a sum of named terms (bytes on this rank's device at the phase's peak):

- ``train_step`` (forward + backward of one microbatch): the master weights, their gradients
  (the worker keeps both in ``master_bytes``, fp32) when they are live during the forward (a
  step of several microbatches accumulates them; the first microbatch of a step starts with
  none, so a one-microbatch step peaks without them and allocates them during the backward as
  the activations are freed), the optimizer state (``optimizer_states`` master-sized tensors:
  AdamW 2, SGD with momentum 1; plus, with ``factored_optimizer_state``, Adafactor's row and
  column statistics, ``ModelShape.factored_state_elements`` master-dtype values: see
  `optimizer_memory`), the autocast copies of the weights in ``compute_bytes``
  (cached for the backward), the activations the backward keeps for ``train_mb_tokens``
  tokens, and the ``[T, V]`` logits with their gradient (plus fp32 scratch of
  ``train_logprob_chunk`` positions where the logprob kernels are not fused);
- ``optimizer_step``: weights, gradients, state, and one master-sized temporary of the
  multi-tensor update (``per_tensor_update``, e.g. Adafactor's default: the largest trainable
  tensor's, as the update runs one parameter at a time);
- ``logprobs`` / ``reference`` / ``topk`` (no grad): weights, the optimizer state unless it is
  offloaded, the head cast once, one layer's transient activations of ``logprob_mb_tokens``,
  the kept last hidden states, and one LM-head chunk of ``logprob_chunk_tokens`` tokens (the
  reference weights are swapped in from a CPU copy, so ``reference`` equals ``logprobs``);
- ``refit``: weights, the staged buckets (``refit_slots`` buffers of ``refit_bucket_bytes``) or,
  one-pass, an arena of every exported tensor in ``export_bytes``;
- ``checkpoint``: weights, optimizer state, and (sharded) the gather of the largest tensor;
  the sync save's bounce buffers and the async staging are pinned host memory.

Activations per token per decoder layer, autocast over master weights, counted from the tensors
autograd saves for a Qwen2 block (a ``saved_tensors_hooks`` census; residual stream in
``master_bytes``, linear inputs and outputs in ``compute_bytes``):

- eager layers: four residual-dtype tensors (the two RMSNorms' inputs and normalized outputs,
  ``4h``), the six linear inputs (q, k and v each cast their own copy; o, gate and up, ``6h``),
  the attention's q (``h``), k and v (``2 kv``), and four MLP tensors (gate, up, SiLU(gate),
  their product: ``4 i``);
- layers compiled whole (``compiled_layers``: `fusion: layer`): inductor's partitioner recomputes
  the norms and the SiLU product in the backward, keeping one residual-dtype tensor (``h``),
  three linear inputs, the attention's q and output (``5h``), k and v (``2 kv``) and three MLP
  tensors (``3 i``).

RoPE's cos and sin are computed once per forward and shared by every layer (not counted).
SDPA's CPU math backend keeps its output apart from o_proj's input (one more ``h`` in eager
layers); the flash kernels, and ours over packed rows, hand o_proj a view of it.

Above the layers: the final norm's input and output (residual dtype) and its cast
(``compute_bytes``); the embedding output is the first layer's input. With activation
checkpointing only each layer's input stays, plus one layer recomputed at a time. Flash/SDPA
attention keeps no ``[T, T]`` scores, so no quadratic term. MoE layers and vision towers are
not modelled. `bench.memory_plan` compares the phases with ``torch.cuda.max_memory_allocated``.

All functions are pure.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from attrs import frozen

from policyworker.functional.logprobs import default_chunk_size

__all__ = [
    "PHASES",
    "MemoryKnobs",
    "MemoryPlan",
    "ModelShape",
    "PhasePlan",
    "activation_bytes_per_token_layer",
    "inference_chunk_tokens",
    "largest_fitting",
    "plan_memory",
    "with_knob",
]

PHASES = ("train_step", "optimizer_step", "logprobs", "reference", "topk", "refit", "checkpoint")
# Eager chunked logprobs: the fp32 upcast of a chunk, its log-softmax and (backward) its grad.
_EAGER_SCRATCH_COPIES = 3
_TOPK_INDEX_BYTES = 8  # int64 indices beside each kept value
# The scoring loop's LM-head chunk when `logprob_chunk_size` is unset (packed: one row).
_INFERENCE_CHUNK_TOKENS = 2048


@frozen(kw_only=True)
class ModelShape:
    """Parameter counts and the dimensions the activations scale with (per model, unsharded).

    ``num_trainable``: parameters with gradients and optimizer state (all of them, or LoRA's
    adapters); ``kv_dim``: ``num_key_value_heads * head_dim``; ``largest_tensor``: elements of
    the largest single parameter (the embedding or head, usually);
    ``factored_state_elements``: Adafactor's factored second-moment values over the trainable
    parameters (`optimizer_memory.factored_state_elements` of their shapes; 0 where unknown).
    """

    num_params: int
    num_trainable: int
    num_layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int
    largest_tensor: int = 0
    factored_state_elements: int = 0


@frozen(kw_only=True)
class MemoryKnobs:
    """The settings the phases scale with. Byte sizes are per element; ``optimizer_states``,
    ``factored_optimizer_state`` and ``per_tensor_update`` are an
    `optimizer_memory.OptimizerMemory`'s fields."""

    train_mb_tokens: int
    logprob_mb_tokens: int
    logprob_chunk_tokens: int = 0  # 0: the scoring loop's default (`inference_chunk_tokens`)
    train_logprob_chunk: int = 0  # 0: the logprob functions' own default_chunk_size(vocab)
    activation_checkpointing: bool = False
    fused_logprobs: bool = False
    compiled_layers: bool = False
    grads_in_forward: bool = True
    master_bytes: int = 4
    compute_bytes: int = 2
    export_bytes: int = 2
    optimizer_states: int = 2
    factored_optimizer_state: bool = False
    per_tensor_update: bool = False
    optimizer_on_device_for_logprobs: bool = True
    shards: int = 1
    refit_bucket_bytes: int = 0
    refit_slots: int = 2
    one_pass_refit: bool = False
    top_k: int = 0


@frozen
class PhasePlan:
    """One phase's predicted peak: named terms in bytes; `total` is their sum."""

    phase: str
    terms: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.terms)


@frozen
class MemoryPlan:
    """Every phase's plan, in `PHASES` order."""

    phases: tuple[PhasePlan, ...]

    def phase(self, name: str) -> PhasePlan:
        """The plan of phase `name` (one of `PHASES`)."""
        for p in self.phases:
            if p.phase == name:
                return p
        msg = f"phase {name!r} is not one of {PHASES}"
        raise KeyError(msg)

    @property
    def peak(self) -> PhasePlan:
        """The phase with the largest total."""
        return max(self.phases, key=lambda p: p.total)


def activation_bytes_per_token_layer(shape: ModelShape, knobs: MemoryKnobs) -> int:
    """Bytes one decoder layer keeps for the backward per token (no checkpointing)."""
    h, kv, inter = shape.hidden, shape.kv_dim, shape.intermediate
    if knobs.compiled_layers:
        return knobs.master_bytes * h + knobs.compute_bytes * (5 * h + 2 * kv + 3 * inter)
    return 4 * knobs.master_bytes * h + knobs.compute_bytes * (7 * h + 2 * kv + 4 * inter)


def _div(nbytes: int, shards: int) -> int:
    return -(-nbytes // max(shards, 1))


def _resident(shape: ModelShape, knobs: MemoryKnobs) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes on this rank."""
    weights = _div(shape.num_params * knobs.master_bytes, knobs.shards)
    grads = _div(shape.num_trainable * knobs.master_bytes, knobs.shards)
    state_elements = shape.num_trainable * knobs.optimizer_states
    if knobs.factored_optimizer_state:
        state_elements += shape.factored_state_elements
    state = _div(state_elements * knobs.master_bytes, knobs.shards)
    return weights, grads, state


def _update_scratch(shape: ModelShape, knobs: MemoryKnobs, grads: int) -> int:
    """The optimizer step's temporary: none without state (plain SGD adds the gradients in
    place), the largest trainable tensor's for a per-tensor update, else master-sized."""
    if not (knobs.optimizer_states or knobs.factored_optimizer_state):
        return 0
    if knobs.per_tensor_update:
        largest = min(shape.largest_tensor, shape.num_trainable)
        return min(_div(largest * knobs.master_bytes, knobs.shards), grads)
    return grads


def _weight_casts(shape: ModelShape, knobs: MemoryKnobs) -> int:
    if knobs.compute_bytes >= knobs.master_bytes:
        return 0
    return _div(shape.num_params * knobs.compute_bytes, knobs.shards)


def _train_activations(shape: ModelShape, knobs: MemoryKnobs) -> int:
    tokens = knobs.train_mb_tokens
    per_layer = activation_bytes_per_token_layer(shape, knobs) * tokens
    # the final norm's input and output (residual dtype) and its cast; the embedding output
    # is the first layer's input, counted in its layer
    top = (2 * knobs.master_bytes + knobs.compute_bytes) * shape.hidden * tokens
    if not knobs.activation_checkpointing:
        return top + shape.num_layers * per_layer
    # The recomputed layer's own input is its first norm's input, counted in `per_layer`.
    kept_inputs = max(shape.num_layers - 1, 0) * knobs.master_bytes * shape.hidden * tokens
    return top + kept_inputs + (per_layer if shape.num_layers else 0)


def _train_logits(shape: ModelShape, knobs: MemoryKnobs) -> int:
    """The [T, V] logits kept for the backward and their gradient, plus fp32 chunk scratch."""
    block = knobs.train_mb_tokens * shape.vocab * knobs.compute_bytes
    scratch = 0
    if not knobs.fused_logprobs and shape.vocab:
        default = default_chunk_size(shape.vocab)
        chunk = min(knobs.train_logprob_chunk or default, knobs.train_mb_tokens)
        scratch = _EAGER_SCRATCH_COPIES * 4 * chunk * shape.vocab
    return 2 * block + scratch


def inference_chunk_tokens(shape: ModelShape, knobs: MemoryKnobs) -> int:
    """Tokens of one no-grad LM-head chunk: `logprob_chunk_tokens`, else the scoring loop's
    default (the larger of 2048 and `default_chunk_size(vocab)`), at most the microbatch."""
    chunk = knobs.logprob_chunk_tokens
    if not chunk:
        chunk = max(default_chunk_size(shape.vocab), _INFERENCE_CHUNK_TOKENS) if shape.vocab else 0
    return min(chunk, knobs.logprob_mb_tokens)


def _eager_logit_copies(knobs: MemoryKnobs) -> int:
    """Extra bytes per logit of a no-grad chunk: none fused, an fp32 upcast and its
    log-softmax eager."""
    return 0 if knobs.fused_logprobs else 2 * 4


def _inference_terms(shape: ModelShape, knobs: MemoryKnobs) -> list[tuple[str, int]]:
    weights, _, state = _resident(shape, knobs)
    tokens, h = knobs.logprob_mb_tokens, shape.hidden
    head_cast = 0
    if knobs.compute_bytes < knobs.master_bytes:
        head_cast = shape.vocab * h * knobs.compute_bytes
    layer_params = (shape.num_params - 2 * shape.vocab * h) // max(shape.num_layers, 1)
    layer_cast = max(layer_params, 0) * knobs.compute_bytes if head_cast else 0
    residual = 2 * knobs.master_bytes * h * tokens
    mlp = 3 * knobs.compute_bytes * shape.intermediate * tokens if shape.num_layers else 0
    chunk = inference_chunk_tokens(shape, knobs)
    return [
        ("weights", weights),
        ("optimizer_state", state if knobs.optimizer_on_device_for_logprobs else 0),
        ("weight_casts", head_cast + layer_cast),
        ("activations", residual + mlp),
        ("hidden_states", knobs.master_bytes * h * tokens),
        # fused kernels read the chunk's logits in place; eager ones add fp32 copies
        ("logit_chunk", chunk * shape.vocab * (knobs.compute_bytes + _eager_logit_copies(knobs))),
    ]


def plan_memory(shape: ModelShape, knobs: MemoryKnobs) -> MemoryPlan:
    """The predicted peak bytes of every phase in `PHASES` (see the module docstring)."""
    weights, grads, state = _resident(shape, knobs)
    train = PhasePlan(
        "train_step",
        (
            ("weights", weights),
            ("gradients", grads if knobs.grads_in_forward else 0),
            ("optimizer_state", state),
            ("weight_casts", _weight_casts(shape, knobs)),
            ("activations", _train_activations(shape, knobs)),
            ("logits", _train_logits(shape, knobs)),
        ),
    )
    step_scratch = _update_scratch(shape, knobs, grads)
    step = PhasePlan(
        "optimizer_step",
        (
            ("weights", weights),
            ("gradients", grads),
            ("optimizer_state", state),
            ("update_scratch", step_scratch),
        ),
    )
    inference = tuple(_inference_terms(shape, knobs))
    chunk = inference_chunk_tokens(shape, knobs)
    topk_out = knobs.logprob_mb_tokens * knobs.top_k * (knobs.master_bytes + _TOPK_INDEX_BYTES)
    topk_scratch = chunk * knobs.top_k * (4 + _TOPK_INDEX_BYTES)
    staging = _div(shape.num_params * knobs.export_bytes, knobs.shards)
    if not knobs.one_pass_refit:
        staging = min(staging, knobs.refit_slots * knobs.refit_bucket_bytes)
    gather = shape.largest_tensor * knobs.master_bytes if knobs.shards > 1 else 0
    return MemoryPlan(
        (
            train,
            step,
            PhasePlan("logprobs", inference),
            PhasePlan("reference", inference),
            PhasePlan("topk", (*inference, ("topk_values", topk_out + topk_scratch))),
            PhasePlan("refit", (("weights", weights), ("staging", staging))),
            PhasePlan(
                "checkpoint",
                (("weights", weights), ("optimizer_state", state), ("gather", gather)),
            ),
        )
    )


def largest_fitting(
    total_for: Callable[[int], int], *, budget: int, low: int, high: int, multiple: int = 1
) -> int | None:
    """The largest multiple of `multiple` in [low, high] whose `total_for` is <= `budget`, or
    None when not even `low` fits. `total_for` must be non-decreasing (bisection).

    Raises:
        ValueError: ``low < 1``, ``high < low`` or ``multiple < 1``.
    """
    if low < 1 or high < low or multiple < 1:
        msg = f"largest_fitting needs 1 <= low <= high and multiple >= 1; got {low}, {high}, "
        msg += f"{multiple}"
        raise ValueError(msg)
    lo = -(-low // multiple)
    hi = high // multiple
    if hi < lo or total_for(lo * multiple) > budget:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total_for(mid * multiple) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * multiple


def with_knob(knobs: MemoryKnobs, name: str, value: int) -> MemoryKnobs:
    """`knobs` with the integer knob `name` set to `value` (for `largest_fitting`)."""
    return attrs.evolve(knobs, **{name: value})

"""NeMo-RL's names for what policyworker does, in one place, so a NeMo-RL user's code ports by
changing its imports and the core keeps its own names.

- `packing`: `PackingAlgorithm`, `SequencePacker`, `get_packer(...)` (`packer.pack(lengths)`).
- `batching`: `BatchedDataDict`, `SequencePackingArgs`, `DynamicBatchingArgs`.
- `logits`: `TrainingSamplingParams` (positional), `apply_top_k_top_p` -> `(logits, mask)`,
  `get_next_token_logprobs_from_logits(input_ids, logits)`, `prepare_loss_input`.
- `config`: `load_config(path)` (an OmegaConf `DictConfig`; needs `omegaconf`),
  `register_omegaconf_resolvers()`, `parse_hydra_overrides`, `OverridesError`.
- `loss`: the losses and helpers under NeMo-RL's names (`ClippedPGLossFn`, `NLLLossFn`, ...).

`python -m policyworker._dev.nemo_rl_harness <NeMo-RL checkout>` runs NeMo-RL's own unit tests
of these against this package (docs/nemo-rl-compat.md).
"""

from policyworker.nemo_rl.batching import BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs
from policyworker.nemo_rl.config import (
    OverridesError,
    load_config,
    parse_hydra_overrides,
    register_omegaconf_resolvers,
)
from policyworker.nemo_rl.logits import (
    TrainingSamplingParams,
    apply_top_k_top_p,
    get_next_token_logprobs_from_logits,
    need_top_k_or_top_p_filtering,
    prepare_loss_input,
)
from policyworker.nemo_rl.packing import PackingAlgorithm, SequencePacker, get_packer

__all__ = [
    "BatchedDataDict",
    "DynamicBatchingArgs",
    "OverridesError",
    "PackingAlgorithm",
    "SequencePacker",
    "SequencePackingArgs",
    "TrainingSamplingParams",
    "apply_top_k_top_p",
    "get_next_token_logprobs_from_logits",
    "get_packer",
    "load_config",
    "need_top_k_or_top_p_filtering",
    "parse_hydra_overrides",
    "prepare_loss_input",
    "register_omegaconf_resolvers",
]

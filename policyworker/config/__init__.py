"""Typed policy configuration: frozen attrs classes, one cattrs converter, `load_config`.

`load_config(mapping)` is the one way in. It accepts NeMo-RL's `policy:` section unchanged:
the keys this worker reads are structured into the attrs classes (YAML keys are the attribute
names), the NeMo-RL keys it does not read (`IGNORED_NEMO_RL_KEYS`) are dropped and named in
one INFO record; any other key close to a known one is an error with its did-you-mean, and the
rest are accepted, not read, with one `ConfigWarning` (`strict=True` refuses every unknown key).
A bad mapping raises `ConfigError` listing every problem, one per line, each ending
`@ policy.<dotted.path>`.

Optional sections (`sequence_packing`, `dynamic_batching`, `dtensor_cfg.lora_cfg`,
`dtensor_cfg.fp8`, `reward_model_cfg`, `router_replay`, `draft`) follow one rule: absent or
`null` means disabled, and so does NeMo-RL's `{enabled: false, ...}` form; both structure to
`None`. A section given without `enabled`, or with `enabled: true`, is enabled and structures to
its class (which has no `enabled` attribute). The keys of a disabled section are still checked by
name (a typo is an error) but their values are not read; `PolicyConfig.disabled_sections` keeps
them as given.
`PolicyConfig` has `*_enabled` properties for consumers.

The package, by responsibility: `values` (the Literal choices and precision aliases), `rules`
(single-field rules and their errors), `sections` and `policy` (the attrs classes), `nemo_rl_keys`
(the NeMo-RL keys accepted and not read), `converter` (the cattrs hooks), `messages` (error
rendering with did-you-mean), `loading` (`load_config`, `config_to_dict`); `files` reads YAML/JSON
config files the way NeMo-RL does, from `documents` (YAML 1.2 / JSON), `overrides` (Hydra's
grammar) and `interpolation` (OmegaConf-style references and resolvers).
"""

from policyworker.config.converter import converter
from policyworker.config.loading import config_to_dict, load_config
from policyworker.config.nemo_rl_keys import IGNORED_NEMO_RL_KEYS, split_ignored_keys
from policyworker.config.policy import PolicyConfig, validate_for_world
from policyworker.config.rules import ConfigWarning
from policyworker.config.sections import (
    ColocatedConfig,
    DataPlaneConfig,
    DraftConfig,
    DTensorConfig,
    DynamicBatchingConfig,
    Float8Config,
    GenerationConfig,
    LoRAConfig,
    OptimizerConfig,
    RewardModelConfig,
    RouterReplayConfig,
    SchedulerConfig,
    SchedulerEntry,
    SequencePackingConfig,
    TokenizerConfig,
)
from policyworker.config.values import (
    PRECISION_ALIASES,
    AttnImplementation,
    DropoutPosition,
    Float8Recipe,
    FusionMode,
    LoraAInit,
    LoraComputeDtype,
    MicrobatchOrder,
    PackingAlgorithm,
    Precision,
    RewardModelType,
)

__all__ = [
    "IGNORED_NEMO_RL_KEYS",
    "PRECISION_ALIASES",
    "AttnImplementation",
    "ColocatedConfig",
    "ConfigWarning",
    "DTensorConfig",
    "DataPlaneConfig",
    "DraftConfig",
    "DropoutPosition",
    "Float8Config",
    "Float8Recipe",
    "FusionMode",
    "DynamicBatchingConfig",
    "GenerationConfig",
    "LoRAConfig",
    "LoraAInit",
    "LoraComputeDtype",
    "MicrobatchOrder",
    "OptimizerConfig",
    "PackingAlgorithm",
    "PolicyConfig",
    "Precision",
    "RewardModelConfig",
    "RewardModelType",
    "RouterReplayConfig",
    "SchedulerConfig",
    "SchedulerEntry",
    "SequencePackingConfig",
    "TokenizerConfig",
    "config_to_dict",
    "converter",
    "load_config",
    "split_ignored_keys",
    "validate_for_world",
]

"""The sections of a GRPO run file besides `policy:` and `loss_fn:`, as frozen attrs classes.

Keys are NeMo-RL's where NeMo-RL has them (`grpo:`, `checkpointing:`, `logger:`,
`generation.backend`); the data and reward sections are this runner's own (NeMo-RL picks
datasets and environments by name, this runner by file and import path). They are structured by
the config package's converter, so a bad file lists every problem with its path.
"""

from typing import Any

from attrs import field, frozen

from policyworker.config import PolicyConfig
from policyworker.config.rules import POSITIVE, Rule, at_least
from policyworker.functional.grpo import STEP_METRICS

__all__ = [
    "CheckpointingSection",
    "DataSection",
    "EnvSection",
    "GenerationSection",
    "GrpoSection",
    "LoggerSection",
    "RunConfig",
    "RunSections",
    "WandbSection",
]

_IMPORT_PATH = Rule(
    lambda v: v.count(":") == 1 and all(part.strip() for part in v.split(":")),
    "must be module:function",
    "write it like my_rewards:score (a module on sys.path or beside the run file)",
)
_TRAIN_METRIC = Rule(
    lambda v: v.startswith("train:") and v.removeprefix("train:") in STEP_METRICS,
    "must be train:<metric> of a step (this runner has no validation pass)",
    f"use one of {', '.join('train:' + m for m in STEP_METRICS)}",
)
_BACKENDS = ("hf", "vllm")
_BACKEND = Rule(
    lambda v: v in _BACKENDS,
    f"must be one of {list(_BACKENDS)}",
    "hf: the HF inference process refit over ZMQ; vllm: a vLLM engine (pip install "
    "'policyworker[vllm]')",
)


@frozen(kw_only=True)
class GrpoSection:
    """NeMo-RL's `grpo:` keys this runner reads."""

    num_prompts_per_step: int = field(default=8, validator=at_least(1))
    num_generations_per_prompt: int = field(default=4, validator=at_least(1))
    max_num_steps: int = field(default=10, validator=at_least(1))
    max_num_epochs: int | None = field(default=None, validator=at_least(1))
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = True
    seed: int = field(default=42, validator=at_least(0))


@frozen(kw_only=True)
class DataSection:
    """A prompts file, JSONL (one object per line) or Parquet (`.parquet`, one row per prompt;
    needs pyarrow): the text under `prompt_key`; the other fields (or only `metadata_keys`)
    reach the reward function as that row's metadata."""

    train_file: str
    prompt_key: str = "prompt"
    metadata_keys: tuple[str, ...] | None = None
    shuffle: bool = True
    use_chat_template: bool = True  # when the tokenizer has one


@frozen(kw_only=True)
class EnvSection:
    """The reward: `module:function(prompts, responses, metadata) -> rewards`, one float per
    response; `module` is imported with the run file's folder on sys.path."""

    reward_fn: str = field(validator=_IMPORT_PATH)


@frozen(kw_only=True)
class GenerationSection:
    """Sampling: `max_new_tokens` per response (cut at the first eos for the reward and the
    loss), at `temperature` (the policy's `generation.temperature` must agree; 1.0 with vllm,
    whose logprobs are of the unscaled distribution)."""

    backend: str = field(default="hf", validator=_BACKEND)
    max_new_tokens: int = field(default=16, validator=at_least(1))
    temperature: float = field(default=1.0, validator=POSITIVE)
    stop_at_eos: bool = True
    timeout_s: float = field(default=120.0, validator=POSITIVE)


@frozen(kw_only=True)
class CheckpointingSection:
    """NeMo-RL's `checkpointing:` keys: every `save_period` steps (and at the last step) into
    `checkpoint_dir/step_<k>`; keep the `keep_top_k` best by `metric_name` plus the latest."""

    enabled: bool = True
    checkpoint_dir: str = "results/grpo"
    save_period: int = field(default=10, validator=at_least(1))
    keep_top_k: int | None = field(default=3, validator=at_least(1))
    metric_name: str = field(default="train:reward_mean", validator=_TRAIN_METRIC)
    higher_is_better: bool = True


@frozen(kw_only=True)
class WandbSection:
    """NeMo-RL's `logger.wandb:` keys, passed to `wandb.init` (None: wandb's default)."""

    project: str = "grpo-dev"
    name: str = "grpo-dev-logger"
    entity: str | None = None
    group: str | None = None


@frozen(kw_only=True)
class LoggerSection:
    """Stdout lines always, `log_dir/metrics.jsonl` always, TensorBoard
    (`log_dir/tensorboard`) and wandb (`log_dir/wandb`; `WANDB_MODE=offline` keeps it local)
    when enabled, with NeMo-RL's keys."""

    log_dir: str = "logs"
    tensorboard_enabled: bool = False
    wandb_enabled: bool = False
    wandb: WandbSection = WandbSection()


@frozen(kw_only=True)
class RunSections:
    """The runner's own sections, structured together so their problems are listed together."""

    grpo: GrpoSection = GrpoSection()
    data: DataSection
    env: EnvSection
    generation: GenerationSection = GenerationSection()
    checkpointing: CheckpointingSection = CheckpointingSection()
    logger: LoggerSection = LoggerSection()


@frozen(kw_only=True)
class RunConfig:
    """A whole run: the policy, the loss mapping, the runner's sections, and the resolved
    reward function (`base_dir`: the run file's folder, against which relative paths read)."""

    policy: PolicyConfig
    loss_fn: dict[str, Any]
    sections: RunSections
    reward_fn: Any
    base_dir: str

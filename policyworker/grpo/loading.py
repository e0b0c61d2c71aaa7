"""Read a GRPO run file: every section checked, every problem listed, before anything starts.

`load_run_config(path, overrides)` reads the YAML the way `policyworker.config.files` reads a
policy file (`defaults:` chains, Hydra-style overrides with full paths such as
`grpo.max_num_steps=3`, then interpolations), then structures `policy:` (the config package),
`loss_fn:` (ClippedPGLossFn's keys), the runner's sections, imports the reward function and
reads the prompts file. Problems from all of them are collected and raised as one
`ConfigError`, one line per problem, each ending `@ <section>.<path>`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pathlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cattrs.errors import ClassValidationError, IterableValidationError

from policyworker.config import load_config
from policyworker.config.converter import converter
from policyworker.config.files import apply_overrides, read_config_with_defaults
from policyworker.config.interpolation import resolve_interpolations
from policyworker.config.messages import error_lines
from policyworker.errors import ConfigError
from policyworker.functional.loss_options import ClippedPGConfig
from policyworker.grpo.config import RunConfig, RunSections

__all__ = ["import_reward_fn", "load_run_config", "read_prompt_rows"]

_SECTIONS = ("grpo", "data", "env", "generation", "checkpointing", "logger")
_KNOWN = {"policy", "loss_fn", "defaults", *_SECTIONS}


def import_reward_fn(path: str, *, base_dir: str) -> Callable[..., Any]:
    """The function `module:function` names, `module` imported with `base_dir` on sys.path.

    Raises:
        ConfigError: naming the import path and the import's own error.
    """
    module_name, _, attr = path.partition(":")
    if base_dir not in sys.path:
        sys.path.insert(0, base_dir)  # the reward module beside the run file imports by name
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure inside the user's module is a config problem
        msg = f"reward_fn = {path!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        raise ConfigError(msg) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        msg = (
            f"reward_fn = {path!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
            f"has no function {attr!r}; define {attr}(prompts, responses, metadata) -> rewards"
        )
        raise ConfigError(msg)
    return fn


def _parquet_records(path: pathlib.Path) -> list[Any]:
    """The rows of a Parquet file as dicts (pyarrow, imported only for Parquet files).

    Raises:
        ConfigError: pyarrow is missing (naming the extra), or the file does not read.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        msg = (
            f"train_file {str(path)!r}: reading Parquet needs pyarrow ({exc}); pip install "
            f"'policyworker[grpo]', or write the rows as JSONL"
        )
        raise ConfigError(msg) from exc
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow's errors have no common base besides Exception
        msg = f"train_file {str(path)!r}: not a readable Parquet file ({type(exc).__name__}: {exc})"
        raise ConfigError(msg) from exc


def _jsonl_records(path: pathlib.Path) -> list[tuple[int, Any]]:
    """(line number, parsed value or the JSONDecodeError) per non-blank line."""
    records: list[tuple[int, Any]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            records.append((number, exc))
    return records


def read_prompt_rows(path: pathlib.Path, *, prompt_key: str) -> list[dict[str, Any]]:
    """The rows of `path`: a Parquet file (`.parquet`, one row per prompt) or JSONL (one JSON
    object per line, blank lines skipped).

    Raises:
        ConfigError: the file is missing, empty or unreadable, or rows are not objects with a
        text `prompt_key` (the first five bad rows named).
    """
    if not path.is_file():
        raise ConfigError(f"train_file: no such file {str(path)!r}; check the path")
    bad: list[str] = []
    if path.suffix == ".parquet":
        records = list(enumerate(_parquet_records(path), start=1))
        unit, form = "row", "Parquet rows"
    else:
        records = _jsonl_records(path)
        unit, form = "line", "JSONL lines"
    rows: list[dict[str, Any]] = []
    for number, row in records:
        if isinstance(row, json.JSONDecodeError):
            bad.append(f"line {number}: not JSON ({row.msg})")
            continue
        if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
            bad.append(f"{unit} {number}: no text field {prompt_key!r}")
            continue
        rows.append(row)
    if bad:
        raise ConfigError(f"train_file {str(path)!r}: " + "; ".join(bad[:5]))
    if not rows:
        raise ConfigError(f"train_file {str(path)!r} holds no prompt; add {form}")
    return rows


# The fix for each key a run cannot do without, appended to the converter's "required field
# missing" line.
_REQUIRED_FIX = {
    "data": "add data: {train_file: prompts.jsonl} (JSONL or Parquet prompts)",
    "data.train_file": "add train_file: the prompts file (JSONL or Parquet; relative to the run)",
    "env": "add env: {reward_fn: my_rewards:score} (module:function)",
    "env.reward_fn": "add reward_fn: module:function(prompts, responses, metadata) -> rewards",
}


def _with_fix(line: str) -> str:
    head, at, where = line.rpartition(" @ ")
    fix = _REQUIRED_FIX.get(where)
    if at and fix and head.endswith("required field missing"):
        return f"{head}; {fix} @ {where}"
    return line


def _structure_sections(document: Mapping[str, Any], problems: list[str]) -> RunSections | None:
    body = {k: v for k, v in document.items() if k in _SECTIONS}
    try:
        return converter.structure(body, RunSections)
    except (ClassValidationError, IterableValidationError, ValueError) as exc:
        lines = [line.replace("@ run.", "@ ") for line in error_lines(exc, "run", None)]
        problems += [_with_fix(line) for line in lines]
        return None


def _cross_section_problems(run: RunSections, policy: Any) -> list[str]:
    problems = []
    rollouts = run.grpo.num_prompts_per_step * run.grpo.num_generations_per_prompt
    gbs = policy.train_global_batch_size
    if rollouts % gbs:
        problems.append(
            f"num_prompts_per_step * num_generations_per_prompt = {rollouts} is not a multiple "
            f"of policy.train_global_batch_size = {gbs}; make the rollouts of a step whole "
            f"global batches @ grpo.num_prompts_per_step"
        )
    sampling = policy.generation
    policy_t = 1.0 if sampling is None else sampling.temperature
    if policy_t != run.generation.temperature:
        problems.append(
            f"temperature = {run.generation.temperature} but policy.generation.temperature = "
            f"{policy_t}; the trainer's logprobs must use the sampler's temperature: set both "
            f"alike @ generation.temperature"
        )
    if run.generation.backend == "vllm" and run.generation.temperature != 1.0:
        problems.append(
            f"temperature = {run.generation.temperature} with backend vllm: vLLM reports "
            f"logprobs of the unscaled distribution, so the runner samples it at 1.0; set 1.0 "
            f"or use backend hf @ generation.temperature"
        )
    if run.generation.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append(
            "backend = 'vllm' but vLLM is not installed; pip install 'policyworker[vllm]' or "
            "use backend hf @ generation.backend"
        )
    return problems


def _missing_loggers(run: RunSections) -> list[str]:
    wanted = (
        ("tensorboard", run.logger.tensorboard_enabled, "tensorboard"),
        ("wandb", run.logger.wandb_enabled, "'policyworker[grpo]'"),
    )
    return [
        f"{name}_enabled = true but {name} is not installed; pip install {package}, or set it "
        f"false @ logger.{name}_enabled"
        for name, enabled, package in wanted
        if enabled and importlib.util.find_spec(name) is None
    ]


def _apply_run_overrides(
    document: Mapping[str, Any], overrides: Iterable[str], problems: list[str]
) -> Any:
    """Overrides by full path; `policy.*` ones go to the policy section (the override reader
    drops a leading `policy.`, as NeMo-RL's policy overrides have it). One that cannot apply is
    a problem (at its key) and skipped, so the others and the rest of the file are still
    checked."""
    result = dict(document)
    for text in overrides:
        key = text.strip().lstrip("+~").partition("=")[0].strip() or text
        try:
            if key.startswith("policy."):
                result["policy"] = apply_overrides(result.get("policy") or {}, [text])
            else:
                result = apply_overrides(result, [text])
        except ConfigError as exc:
            message = str(exc)
            if key.startswith("policy."):  # the reader's fix names the key relative to policy
                relative = key.removeprefix("policy.")
                message = message.replace(f"'+{relative}=", f"'+policy.{relative}=")
            problems.append(f"{message} @ {key}")
    return result


def load_run_config(path: str | pathlib.Path, overrides: Iterable[str] = ()) -> RunConfig:
    """The checked run of `path` with `overrides` (`section.key=value`) applied.

    Raises:
        ConfigError: listing every problem of every section, each with its path.
    """
    file = pathlib.Path(path).resolve()
    if not file.is_file():
        raise ConfigError(f"--config {str(path)!r}: no such file; pass a run YAML")
    problems: list[str] = []
    document = resolve_interpolations(
        _apply_run_overrides(read_config_with_defaults(file), overrides, problems)
    )
    if not isinstance(document, Mapping):
        raise ConfigError(f"{file}: a run file is a mapping of sections")
    problems += [
        f"unknown section {key!r}; the sections are {sorted(_KNOWN - {'defaults'})} @ {key}"
        for key in document
        if key not in _KNOWN
    ]
    policy = None
    try:
        policy = load_config(document.get("policy") or {})
    except ConfigError as exc:
        problems += [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
    loss = dict(document.get("loss_fn") or {})
    try:
        ClippedPGConfig.from_mapping(loss)
    except (ConfigError, ValueError) as exc:
        problems += [line.strip() for line in str(exc).splitlines() if line.strip()]
    sections = _structure_sections(document, problems)
    base_dir = str(file.parent)
    if sections is not None and policy is not None:
        problems += _cross_section_problems(sections, policy)
    # The reward and the prompts are checked even when another section failed: all at once.
    env, data = document.get("env"), document.get("data")
    reward_path = env.get("reward_fn") if isinstance(env, Mapping) else None
    reward_fn = None
    if isinstance(reward_path, str) and ":" in reward_path:
        try:
            reward_fn = import_reward_fn(reward_path, base_dir=base_dir)
        except ConfigError as exc:
            problems.append(f"{exc} @ env.reward_fn")
    train_file = data.get("train_file") if isinstance(data, Mapping) else None
    if isinstance(train_file, str):
        prompt_key = data.get("prompt_key", "prompt") if isinstance(data, Mapping) else "prompt"
        try:
            read_prompt_rows(pathlib.Path(base_dir, train_file), prompt_key=str(prompt_key))
        except ConfigError as exc:
            problems.append(f"{exc} @ data.train_file")
    if sections is not None:
        problems += _missing_loggers(sections)
    template = None if policy is None else policy.tokenizer.chat_template
    if template is not None and template.endswith(".jinja"):
        template_file = pathlib.Path(base_dir, template)
        if not template_file.is_file():
            problems.append(
                f"chat_template = {template!r}: no such file {str(template_file)!r}; give a "
                f"*.jinja path relative to the run file, a literal template, 'default' or null "
                f"@ policy.tokenizer.chat_template"
            )
    if problems:
        head = f"invalid run config {file} ({len(problems)} problem{'s' * (len(problems) != 1)}):"
        raise ConfigError("\n  ".join([head, *problems]))
    assert policy is not None and sections is not None
    return RunConfig(
        policy=policy, loss_fn=loss, sections=sections, reward_fn=reward_fn, base_dir=base_dir
    )

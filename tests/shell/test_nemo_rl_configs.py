"""NeMo-RL config files load as NeMo-RL loads them: defaults chains, interpolation, key families.

The expected values below were checked against NeMo-RL's own loader (OmegaConf merge and
resolution) on the same files; the corpus test runs over NeMo-RL's example configs in
../shared/reference/nemo_rl_configs when that folder is present beside the checkout.
"""

import json
import logging
import pathlib
import warnings

import pytest

from policyworker.config import ConfigWarning, LoRAConfig, config_to_dict, load_config
from policyworker.config.files import (
    load_config_file,
    merge_config_layers,
    read_config_section,
    read_config_with_defaults,
    resolve_subtree,
)
from policyworker.errors import ConfigError
from policyworker.functional.loss_options import ClippedPGConfig, DPOConfig

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "nemo_rl"
CORPUS = pathlib.Path(__file__).resolve().parents[3] / "shared" / "reference" / "nemo_rl_configs"


def test_base_document_relative_and_absolute_interpolation():
    policy = read_config_section(DATA / "base_grpo.yaml")
    generation = policy["generation"]
    assert policy["tokenizer"]["name"] == "tiny/base-model"  # ${policy.model_name}
    assert policy["logprob_batch_size"] == 2  # ${.train_micro_batch_size}
    assert policy["make_sequence_length_divisible_by"] == 1  # ${.dtensor_cfg.tensor_parallel_size}
    assert policy["dynamic_batching"]["train_mb_tokens"] == 512  # ${mul:${..a}, ${..b}}
    assert (generation["val_temperature"], generation["val_top_p"], generation["val_top_k"]) == (
        0.7,
        1.0,
        None,
    )  # ${.temperature} ...
    assert generation["max_new_tokens"] == 256  # ${..max_total_sequence_length}
    assert generation["vllm_cfg"]["max_model_len"] == 256  # ${...max_total_sequence_length}
    assert generation["vllm_cfg"]["precision"] == "float32"
    assert generation["refit_transport"] == "UCX"  # ${.refit_cfg.nixl.backend_name}
    assert "${" not in json.dumps(policy)


def test_base_document_loads_and_lists_the_unused_keys_once(caplog):
    with caplog.at_level(logging.INFO, logger="policyworker"):
        cfg = load_config_file(DATA / "base_grpo.yaml")
    records = [r for r in caplog.records if "accepted, not used" in r.getMessage()]
    assert len(records) == 1
    for key in (
        "generation.val_temperature",
        "generation.val_top_k",
        "generation.val_top_p",
        "generation.port_range_low",
        "generation.port_range_high",
        "generation.refit_cfg",
        "generation.refit_transport",
        "generation.real_quant_export_cpu_offload",
        "tokenizer.use_fastokens",
        "megatron_cfg",
        "dtensor_cfg.env_vars",
        "generation.vllm_cfg",
    ):
        assert f"policy.{key}" in records[0].getMessage()
    assert "policy.draft" not in records[0].getMessage()  # draft keys are read (DraftConfig)
    assert cfg.dynamic_batching is not None and cfg.dynamic_batching.logprob_tokens == 512
    assert cfg.generation is not None and cfg.generation.temperature == 0.7
    assert not cfg.lora_enabled and not cfg.sequence_packing_enabled and not cfg.draft_enabled


def test_one_parent_deep_merge_override_marker_and_missing_value():
    document = read_config_with_defaults(DATA / "child_packing_lora.yaml")
    assert document["grpo"] == {"num_prompts_per_step": 16}  # _override_ replaced the section
    policy = read_config_section(DATA / "child_packing_lora.yaml")
    assert policy["train_micro_batch_size"] == 2  # ??? keeps the parent's value
    assert policy["optimizer"]["kwargs"]["eps"] == 1e-8  # untouched parent keys survive
    assert policy["generation"]["val_temperature"] == 1.0  # re-resolved after the merge
    cfg = load_config_file(DATA / "child_packing_lora.yaml")
    assert cfg.sequence_packing is not None and cfg.sequence_packing.train_mb_tokens == 1024
    assert not cfg.dynamic_batching_enabled
    assert cfg.dtensor_cfg.lora_cfg == LoRAConfig(
        exclude_modules=("*out_proj*",), match_all_linear=False, use_triton=False
    )


def test_a_list_of_defaults_two_levels_down():
    cfg = load_config_file(DATA / "recipes" / "grandchild.yaml")
    assert cfg.model_name == cfg.tokenizer_name == "tiny/child-model"
    assert cfg.precision == "bfloat16"  # from the second parent
    assert cfg.dtensor_cfg.tensor_parallel_size == cfg.make_sequence_length_divisible_by == 2
    assert cfg.generation is not None and cfg.generation.top_k == 20
    assert cfg.max_grad_norm == 0.25  # ${div:1, 4}
    lora = cfg.dtensor_cfg.lora_cfg
    assert lora is not None and (lora.dim, lora.alpha) == (16, 32.0)
    assert cfg.sequence_packing is not None and cfg.sequence_packing.train_mb_tokens == 1024


def test_dotted_overrides_apply_before_relative_interpolation():
    cfg = load_config_file(
        DATA / "base_grpo.yaml",
        overrides=[
            "train_micro_batch_size=4",
            "policy.generation.temperature=0.5",
            "dtensor_cfg.lora_cfg.enabled=true",
            "dtensor_cfg.lora_cfg.match_all_linear=false",
            "dtensor_cfg.lora_cfg.target_modules=['*_proj']",
            "dtensor_cfg.lora_cfg.use_triton=false",
        ],
    )
    assert cfg.logprob_batch_size == 4 and cfg.train_micro_batch_size == 4
    assert cfg.dynamic_batching is not None and cfg.dynamic_batching.train_mb_tokens == 1024
    assert cfg.generation is not None and cfg.generation.temperature == 0.5
    assert cfg.dtensor_cfg.lora_cfg is not None
    assert cfg.dtensor_cfg.lora_cfg.target_modules == ("*_proj",)


def test_loss_blocks_load_into_our_loss_configs():
    pg = ClippedPGConfig.from_mapping(read_config_section(DATA / "base_grpo.yaml", "loss_fn"))
    assert (pg.reference_policy_kl_penalty, pg.ratio_clip_max) == (0.02, 0.2)
    dpo = DPOConfig.from_mapping(read_config_section(DATA / "dpo.yaml", "dpo"))
    assert (dpo.reference_policy_kl_penalty, dpo.preference_loss_weight) == (0.1, 1.0)
    assert dpo.sft_average_log_probs is False
    dpo_policy = load_config_file(DATA / "dpo.yaml")
    assert dpo_policy.generation is None and dpo_policy.precision == "float32"


def test_a_second_policy_block_and_root_relative_references():
    teacher = load_config(read_config_section(DATA / "distillation.yaml", "teacher"))
    assert (teacher.model_name, teacher.train_micro_batch_size) == ("tiny/teacher", 2)
    assert read_config_section(DATA / "distillation.yaml", "loss_fn")["kl_type"] == "mixed"


def test_merge_rules_and_errors(tmp_path):
    base = {"a": {"b": 1, "c": [1, 2]}, "d": {"e": 1}, "keep": "x"}
    over = {"a": {"c": [3], "n": None}, "d": {"_override_": True, "f": 2}, "keep": "???"}
    assert merge_config_layers(base, over) == {
        "a": {"b": 1, "c": [3], "n": None},
        "d": {"f": 2},
        "keep": "x",
    }
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": {"e": 1}, "keep": "x"}  # pure
    (tmp_path / "loop_a.yaml").write_text("defaults: loop_b.yaml\nx: 1\n")
    (tmp_path / "loop_b.yaml").write_text("defaults: loop_a.yaml\ny: 1\n")
    with pytest.raises(ConfigError, match="loops back"):
        read_config_with_defaults(tmp_path / "loop_a.yaml")
    (tmp_path / "orphan.yaml").write_text("defaults: [missing.yaml]\n")
    with pytest.raises(ConfigError, match="names 'missing.yaml'.*relative to the file"):
        read_config_with_defaults(tmp_path / "orphan.yaml")
    with pytest.raises(ConfigError, match="goes 3 levels up, above the top"):
        resolve_subtree({"a": {"b": "${...x}"}}, ())
    with pytest.raises(ConfigError, match=r"refers to 'a\.y', which does not exist"):
        resolve_subtree({"a": {"b": "${.y}"}}, ())
    assert resolve_subtree({"a": {"l": ["${..t}", {"q": "${...t}"}], "t": 3}}, ("a",)) == {
        "l": [3, {"q": 3}],
        "t": 3,
    }


def _is_dtensor_policy(document: dict) -> bool:
    policy = document.get("policy")
    if not isinstance(policy, dict):
        return False
    dtensor, megatron = policy.get("dtensor_cfg") or {}, policy.get("megatron_cfg") or {}
    return dtensor.get("enabled") is True and megatron.get("enabled") is not True


def _leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    else:
        yield path, node


@pytest.mark.skipif(not CORPUS.is_dir(), reason=f"{CORPUS} is absent (NeMo-RL's example configs)")
def test_every_dtensor_config_of_nemo_rl_loads_unchanged():
    files = sorted((CORPUS / "examples" / "configs").rglob("*.yaml"))
    loaded, failures = 0, []
    for path in files:
        document = read_config_with_defaults(path)
        if not _is_dtensor_policy(document):
            continue
        try:
            policy = resolve_subtree(document, ("policy",))
            with warnings.catch_warnings():  # e.g. sequence_parallel with tp 1: valid, no effect
                warnings.simplefilter("ignore", ConfigWarning)
                cfg = load_config(policy)
        except ConfigError as exc:
            failures.append(f"{path.relative_to(CORPUS)}: {exc}")
            continue
        assert "${" not in json.dumps(policy)
        # every value this worker reads is the resolved value, unchanged by structuring
        ours = config_to_dict(cfg)
        for key_path, value in _leaves(ours):
            node = policy
            for key in key_path:
                node = node.get(key) if isinstance(node, dict) else None
            if node is not None and not isinstance(node, dict | list) and key_path[-1] != "top_k":
                assert node == value, (path, key_path)
        loaded += 1
    assert not failures, "\n".join(failures)
    assert loaded >= 118

"""Config files: NeMo-RL YAML loads unchanged, overrides, interpolations, provenance JSON."""

import json
import logging
import textwrap
import warnings

import pytest

from policyworker.config import ConfigWarning, PolicyConfig, config_to_dict, load_config
from policyworker.config.files import (
    apply_overrides,
    load_config_file,
    log_config,
    parse_override,
    read_config_document,
    resolve_interpolations,
    select_policy,
)
from policyworker.errors import ConfigError

# A GRPO recipe as NeMo-RL writes it (grpo_math_1B style): OmegaConf interpolations, the
# Megatron and vLLM sections this worker does not read, YAML-1.1-unfriendly `eps: 1e-8`.
# Two `train_mb_tokens` lines run past 100 chars; they stay verbatim (the test is that NeMo-RL's
# text loads unchanged), hence the E501 noqa where the string ends.
NEMO_RL_GRPO_YAML = textwrap.dedent(
    """\
    grpo:
      num_prompts_per_step: 32
      num_generations_per_prompt: 16
      max_num_steps: 1000000
      normalize_rewards: true
      use_leave_one_out_baseline: true

    loss_fn:
      reference_policy_kl_penalty: 0.01
      ratio_clip_min: 0.2
      ratio_clip_max: 0.2
      use_on_policy_kl_approximation: false
      use_importance_sampling_correction: false
      token_level_loss: true

    policy:
      model_name: "Qwen/Qwen2.5-1.5B"
      tokenizer:
        name: ${policy.model_name}
        chat_template_kwargs: null
      hf_config_overrides: {}
      train_global_batch_size: 512
      train_micro_batch_size: 4
      generation_batch_size: 32
      logprob_batch_size: 4
      max_total_sequence_length: 512
      precision: "bfloat16"
      logprob_chunk_size: null
      offload_optimizer_for_logprob: false

      dtensor_cfg:
        _v2: true
        enabled: true
        cpu_offload: false
        sequence_parallel: false
        activation_checkpointing: false
        tensor_parallel_size: 1
        context_parallel_size: 1
        custom_parallel_plan: null
        lora_cfg:
          enabled: false
          target_modules: []
          exclude_modules: []
          match_all_linear: true
          dim: 8
          alpha: 32
          dropout: 0.0
          dropout_position: "post"
          lora_A_init: "xavier"
          use_triton: true

      megatron_cfg:
        enabled: false
        empty_unused_memory_level: 1
        activation_checkpointing: false
        converter_type: "Qwen2ForCausalLM"
        tensor_model_parallel_size: 1
        expert_tensor_parallel_size: 1
        expert_model_parallel_size: 1
        pipeline_model_parallel_size: 1
        num_layers_in_first_pipeline_stage: null
        num_layers_in_last_pipeline_stage: null
        context_parallel_size: 1
        pipeline_dtype: ${policy.precision}
        sequence_parallel: false
        freeze_moe_router: true
        apply_rope_fusion: true
        optimizer:
          optimizer: "adam"
          lr: 5.0e-6
          min_lr: 5.0e-7
          weight_decay: 0.01
          bf16: true
          fp16: false
          params_dtype: "float32"
          adam_beta1: 0.9
          adam_beta2: 0.999
          adam_eps: 1e-8
          use_distributed_optimizer: true
          use_precision_aware_optimizer: true
          clip_grad: ${policy.max_grad_norm}
        scheduler:
          start_weight_decay: ${policy.megatron_cfg.optimizer.weight_decay}
          end_weight_decay: ${policy.megatron_cfg.optimizer.weight_decay}
          weight_decay_incr_style: "constant"
          lr_decay_style: "constant"
          lr_decay_iters: null
          lr_warmup_iters: 13
          lr_warmup_init: 5.0e-7
        distributed_data_parallel_config:
          grad_reduce_in_fp32: false
          overlap_grad_reduce: true
          overlap_param_gather: true
          use_custom_fsdp: false
          data_parallel_sharding_strategy: "optim_grads_params"

      dynamic_batching:
        enabled: true
        train_mb_tokens: ${mul:${policy.max_total_sequence_length}, ${policy.train_micro_batch_size}}
        logprob_mb_tokens: ${mul:${policy.max_total_sequence_length}, ${policy.logprob_batch_size}}
        sequence_length_round: 64

      sequence_packing:
        enabled: false
        train_mb_tokens: ${mul:${policy.max_total_sequence_length}, ${policy.train_micro_batch_size}}
        logprob_mb_tokens: ${mul:${policy.max_total_sequence_length}, ${policy.logprob_batch_size}}
        algorithm: "modified_first_fit_decreasing"
        sequence_length_round: 64

      make_sequence_length_divisible_by: ${policy.dtensor_cfg.tensor_parallel_size}
      max_grad_norm: 1.0

      optimizer:
        name: "torch.optim.AdamW"
        kwargs:
          lr: 5.0e-6
          weight_decay: 0.01
          betas: [0.9, 0.999]
          eps: 1e-8
          foreach: false
          fused: false

      scheduler:
        - name: "torch.optim.lr_scheduler.LinearLR"
          kwargs:
            start_factor: 0.1
            end_factor: 1.0
            total_iters: 50
        - name: "torch.optim.lr_scheduler.ConstantLR"
          kwargs:
            factor: 1.0
            total_iters: 10000000000
        - milestones: [50]

      generation:
        backend: "vllm"
        max_new_tokens: ${policy.max_total_sequence_length}
        temperature: 1.0
        top_p: 1.0
        top_k: null
        stop_token_ids: null
        stop_strings: null
        vllm_cfg:
          async_engine: false
          precision: ${policy.precision}
          tensor_parallel_size: 1
          pipeline_parallel_size: 1
          expert_parallel_size: 1
          gpu_memory_utilization: 0.6
          max_model_len: ${policy.max_total_sequence_length}
          enforce_eager: false
        colocated:
          enabled: true
          resources:
            gpus_per_node: null
            num_nodes: null

    cluster:
      gpus_per_node: 1
      num_nodes: 1
    """  # noqa: E501
)


@pytest.fixture
def nemo_rl_yaml(tmp_path):
    path = tmp_path / "grpo_math_1B.yaml"
    path.write_text(NEMO_RL_GRPO_YAML)
    return path


def test_nemo_rl_grpo_policy_block_loads_unchanged(nemo_rl_yaml, caplog):
    with caplog.at_level(logging.INFO, logger="policyworker"):
        cfg = load_config_file(nemo_rl_yaml)
    ignored = [r for r in caplog.records if "accepted, not used" in r.getMessage()]
    assert len(ignored) == 1
    for path in (
        "policy.megatron_cfg",
        "policy.dtensor_cfg._v2",
        "policy.dtensor_cfg.enabled",
        "policy.generation.vllm_cfg",
        "policy.generation.backend",
        "policy.generation_batch_size",
        "policy.generation.colocated.resources",
        "policy.sequence_packing.sequence_length_round",
    ):
        assert path in ignored[0].getMessage()
    assert cfg.model_name == cfg.tokenizer_name == "Qwen/Qwen2.5-1.5B"
    assert (cfg.train_global_batch_size, cfg.train_micro_batch_size) == (512, 4)
    assert cfg.make_sequence_length_divisible_by == 1
    assert cfg.dynamic_batching_enabled and not cfg.sequence_packing_enabled
    assert cfg.dynamic_batching is not None
    assert (cfg.dynamic_batching.train_mb_tokens, cfg.dynamic_batching.logprob_mb_tokens) == (
        2048,
        2048,
    )
    assert not cfg.lora_enabled
    assert cfg.optimizer is not None
    assert cfg.optimizer.kwargs == {
        "lr": 5e-6,
        "weight_decay": 0.01,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "foreach": False,
        "fused": False,
    }
    assert cfg.scheduler is not None
    assert [e.name for e in cfg.scheduler.entries] == [
        "torch.optim.lr_scheduler.LinearLR",
        "torch.optim.lr_scheduler.ConstantLR",
    ]
    assert cfg.scheduler.milestones == (50,)
    assert cfg.generation is not None and cfg.generation.colocated.enabled
    assert cfg.generation.top_k is None


def test_provenance_json_reloads_to_the_same_config(nemo_rl_yaml, tmp_path, caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = load_config_file(nemo_rl_yaml)
    with caplog.at_level(logging.INFO, logger="policyworker.config.files"):
        line = log_config(cfg)
    assert line in caplog.text
    assert "\n" not in line
    assert load_config(json.loads(line)) == cfg
    saved = tmp_path / "provenance.json"
    saved.write_text(line)
    assert load_config_file(saved) == cfg


def test_overrides_apply_before_interpolation(nemo_rl_yaml):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = load_config_file(
            nemo_rl_yaml,
            overrides=[
                "max_total_sequence_length=1024",
                "policy.dtensor_cfg.tensor_parallel_size=2",
                "dtensor_cfg.lora_cfg.enabled=true",
                "generation.top_k=50",
            ],
        )
    assert cfg.dynamic_batching is not None and cfg.dynamic_batching.train_mb_tokens == 4096
    assert cfg.dtensor_cfg.tensor_parallel_size == cfg.make_sequence_length_divisible_by == 2
    assert cfg.lora_enabled and cfg.dtensor_cfg.lora_cfg is not None
    assert cfg.dtensor_cfg.lora_cfg.alpha == 32.0
    assert cfg.generation is not None and cfg.generation.top_k == 50


def test_a_bad_override_is_reported_with_its_path(nemo_rl_yaml):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        with pytest.raises(
            ConfigError,
            match=r"extra fields found \(tensor_paralel_size: did you mean "
            r"'tensor_parallel_size'\?\) @ policy\.dtensor_cfg$",
        ):
            load_config_file(nemo_rl_yaml, overrides=["+dtensor_cfg.tensor_paralel_size=2"])
    with pytest.raises(
        ConfigError,
        match=r"could not override 'dtensor_cfg\.tensor_paralel_size': the config has no key "
        r"'dtensor_cfg\.tensor_paralel_size' \(did you mean 'dtensor_cfg\.tensor_parallel_size'\?\)"
        r".*write '\+dtensor_cfg\.tensor_paralel_size=\.\.\.'",
    ):
        load_config_file(nemo_rl_yaml, overrides=["dtensor_cfg.tensor_paralel_size=2"])


def test_bare_policy_mapping_and_json_files_load(tmp_path):
    bare = tmp_path / "policy.yaml"
    bare.write_text(
        "model_name: tiny\ntokenizer:\n  name: ${policy.model_name}-tok\n"
        "optimizer:\n  name: torch.optim.SGD\n  kwargs: {lr: 5e-3}\n"
    )
    cfg = load_config_file(bare)
    assert cfg.tokenizer_name == "tiny-tok"
    assert cfg.optimizer is not None and cfg.optimizer.kwargs == {"lr": 5e-3}
    as_json = tmp_path / "policy.json"
    as_json.write_text(json.dumps({"policy": {"model_name": "tiny", "precision": "float32"}}))
    assert load_config_file(as_json) == PolicyConfig(model_name="tiny", precision="float32")


def test_apply_overrides_is_pure_and_parses_yaml_values():
    original = {"dtensor_cfg": {"tensor_parallel_size": 1}, "model_name": "m"}
    updated = apply_overrides(
        original,
        [
            "dtensor_cfg.tensor_parallel_size=2",
            "+generation.top_k=null",
            "++optimizer.kwargs.betas=[0.9, 0.95]",
            "+tokenizer.name=my/tok",
            "+max_grad_norm=1e-1",
        ],
    )
    assert original == {"dtensor_cfg": {"tensor_parallel_size": 1}, "model_name": "m"}
    assert updated == {
        "dtensor_cfg": {"tensor_parallel_size": 2},
        "model_name": "m",
        "generation": {"top_k": None},
        "optimizer": {"kwargs": {"betas": [0.9, 0.95]}},
        "tokenizer": {"name": "my/tok"},
        "max_grad_norm": 0.1,
    }
    assert parse_override("policy.a.b=true") == (("a", "b"), True)


@pytest.mark.parametrize("text", ["no_equals_sign", "=3", "a..b=1", ".a=1"])
def test_malformed_override_is_rejected(text):
    with pytest.raises(ConfigError, match="must look like dotted.key=value"):
        apply_overrides({}, [text])


def test_override_through_a_scalar_says_which_key():
    with pytest.raises(ConfigError, match=r"'model_name' holds 'm', not a mapping"):
        apply_overrides({"model_name": "m"}, ["model_name.x=1"])


def test_interpolation_rules():
    doc = {
        "a": {"n": 3, "s": "x"},
        "b": "${a.n}",
        "c": "${mul:${a.n}, 4}",
        "d": "id-${a.s}-${a.n}",
        "e": "${max:${c}, 5, 2}",
        "f": ["${b}"],
        "g": "${add:1, 2.5}",
    }
    assert resolve_interpolations(doc) == {
        "a": {"n": 3, "s": "x"},
        "b": 3,
        "c": 12,
        "d": "id-x-3",
        "e": 12,
        "f": [3],
        "g": 3.5,
    }
    with pytest.raises(ConfigError, match=r"refers to 'a\.missing', which does not exist"):
        resolve_interpolations({"a": {}, "b": "${a.missing}"})
    with pytest.raises(ConfigError, match="unknown resolver 'pow'"):
        resolve_interpolations({"b": "${pow:2, 3}"})
    with pytest.raises(ConfigError, match="reference cycle"):
        resolve_interpolations({"a": "${b}", "b": "${a}"})
    with pytest.raises(ConfigError, match="has no closing"):
        resolve_interpolations({"a": "${b"})


def test_document_shape_errors(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        select_policy([1, 2], source="x.yaml")
    with pytest.raises(ConfigError, match="`policy:` must be a mapping"):
        select_policy({"policy": 3}, source="x.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("policy: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse the config file"):
        read_config_document(broken)


def test_yaml_reads_exponent_floats_as_numbers(tmp_path):
    path = tmp_path / "n.yaml"
    path.write_text("a: 1e-8\nb: 5E3\nc: 1.5\nd: 12\ne: '1e-8'\nf: .inf\n")
    assert read_config_document(path) == {
        "a": 1e-8,
        "b": 5e3,
        "c": 1.5,
        "d": 12,
        "e": "1e-8",
        "f": float("inf"),
    }


def test_config_to_dict_is_what_log_config_writes():
    cfg = PolicyConfig(model_name="m")
    assert json.loads(log_config(cfg)) == json.loads(json.dumps(config_to_dict(cfg)))


def test_a_loss_fn_typo_gets_a_did_you_mean(nemo_rl_yaml):
    from policyworker.config.files import read_config_section
    from policyworker.functional.loss import ClippedPGLossFn

    block = read_config_section(nemo_rl_yaml, "loss_fn")
    assert ClippedPGLossFn(block).reference_policy_kl_penalty == 0.01
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'reference_policy_kl_penalti' \(did you "
        r"mean 'reference_policy_kl_penalty'\? accepted keys",
    ):
        ClippedPGLossFn({**block, "reference_policy_kl_penalti": 0.1})

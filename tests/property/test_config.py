"""Properties of the typed config: round trip, every problem reported with its path, NeMo-RL
keys ignored with one warning, cross-field rules stating the fix."""

import copy
import json
import logging
import re
import warnings
from typing import Any, get_args

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.config import (
    IGNORED_NEMO_RL_KEYS,
    PRECISION_ALIASES,
    AttnImplementation,
    ColocatedConfig,
    ConfigWarning,
    DraftConfig,
    DropoutPosition,
    DTensorConfig,
    DynamicBatchingConfig,
    Float8Config,
    Float8Recipe,
    GenerationConfig,
    LoraAInit,
    LoraComputeDtype,
    LoRAConfig,
    MicrobatchOrder,
    OptimizerConfig,
    PackingAlgorithm,
    PolicyConfig,
    Precision,
    RewardModelConfig,
    RewardModelType,
    RouterReplayConfig,
    SchedulerConfig,
    SchedulerEntry,
    SequencePackingConfig,
    TokenizerConfig,
    config_to_dict,
    converter,
    load_config,
    split_ignored_keys,
    validate_for_world,
)
from policyworker.errors import ConfigError

Path = tuple[str | int, ...]
FREE_DICTS = {"kwargs", "hf_config_overrides", "chat_template_kwargs"}  # any keys allowed inside

NAMES = st.sampled_from(["lr", "betas", "eps", "factor", "total_iters", "rope_theta", "x_1"])
DOTTED = st.lists(NAMES, min_size=2, max_size=3).map(".".join)
TEXT = st.text(alphabet="abQ/-_.0", min_size=1, max_size=6)
SCALARS = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | TEXT | st.floats(-1e9, 1e9)
KWARGS = st.dictionaries(NAMES, SCALARS | st.lists(SCALARS, max_size=2), max_size=3)
PATTERNS = ["q_proj", "v_proj", "mlp.down_proj", "re:.*\\.o_proj", "re:layers\\.[0-9]+\\.k_proj"]
MODULE_PATTERNS = st.lists(st.sampled_from(PATTERNS), max_size=4, unique=True).map(tuple)
POSITIVE_FLOATS = st.floats(1e-6, 1e6)
SIZES = st.integers(1, 10**6)


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


def one_of_literal(literal: Any) -> st.SearchStrategy[str]:
    return st.sampled_from(get_args(literal))


@st.composite
def lora_configs(draw) -> LoRAConfig:
    match_all = draw(st.booleans())
    targets = draw(MODULE_PATTERNS.filter(lambda t: match_all or len(t) > 0))
    return LoRAConfig(
        target_modules=targets,
        exclude_modules=draw(MODULE_PATTERNS),
        match_all_linear=match_all,
        dim=draw(st.integers(1, 256)),
        alpha=draw(POSITIVE_FLOATS),
        dropout=draw(st.floats(0.0, 0.99)),
        dropout_position=draw(one_of_literal(DropoutPosition)),
        lora_A_init=draw(one_of_literal(LoraAInit)),
        use_rslora=draw(st.booleans()),
        use_triton=draw(st.booleans()),
        compute_dtype=draw(one_of_literal(LoraComputeDtype)),
    )


@st.composite
def scheduler_configs(draw) -> SchedulerConfig:
    entry = st.builds(SchedulerEntry, name=DOTTED, kwargs=KWARGS)
    entries = draw(st.lists(entry, min_size=1, max_size=3))
    gaps = st.integers(1, 1000)
    steps = draw(st.lists(gaps, min_size=len(entries) - 1, max_size=len(entries) - 1))
    milestones = tuple(
        sum(steps[: i + 1]) for i in range(len(steps))
    )  # increasing, by construction
    return SchedulerConfig(entries=tuple(entries), milestones=milestones)


@st.composite
def batching_sections(draw, *, cp: int, reward: bool):
    """(mode, sequence_packing, dynamic_batching).

    Packing only where cp == 1 and no reward model.
    """
    mode = draw(
        st.sampled_from(["fixed", "dynamic"] + (["packing"] if cp == 1 and not reward else []))
    )
    if mode == "packing":
        packing = SequencePackingConfig(
            train_mb_tokens=draw(SIZES),
            logprob_mb_tokens=draw(optional(SIZES)),
            algorithm=draw(one_of_literal(PackingAlgorithm)),
            microbatch_order=draw(one_of_literal(MicrobatchOrder)),
        )
        return mode, packing, None
    if mode == "dynamic":
        dynamic = DynamicBatchingConfig(
            train_mb_tokens=draw(SIZES),
            logprob_mb_tokens=draw(optional(SIZES)),
            sequence_length_round=draw(st.integers(1, 256)),
        )
        return mode, None, dynamic
    return mode, None, None


@st.composite
def policy_configs(draw) -> PolicyConfig:
    """Valid configs, built constructively so every cross-field rule holds."""
    tp, cp, reward = draw(st.integers(1, 8)), draw(st.integers(1, 4)), draw(st.booleans())
    mode, packing, dynamic = draw(batching_sections(cp=cp, reward=reward))
    mbs = draw(st.integers(1, 16))
    gbs = mbs * draw(st.integers(1, 16)) if mode == "fixed" else draw(st.integers(1, 512))
    cp_lengths = st.integers(1, 256).map(lambda k: 2 * cp * k)
    max_len = draw(optional(cp_lengths if cp > 1 else SIZES))
    generation = st.builds(
        GenerationConfig,
        temperature=POSITIVE_FLOATS,
        top_k=optional(st.integers(1, 1000)),
        top_p=st.floats(1e-3, 1.0),
        colocated=st.builds(ColocatedConfig, enabled=st.booleans()),
    )
    tokenizer = st.builds(
        TokenizerConfig,
        name=optional(TEXT),
        chat_template=optional(st.sampled_from(["default", "t.jinja", "{{x}}"])),
        chat_template_kwargs=optional(KWARGS),
        use_processor=st.booleans(),
    )
    dtensor = DTensorConfig(
        tensor_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=tp > 1 and draw(st.booleans()),
        activation_checkpointing=draw(st.booleans()),
        cpu_offload=draw(st.booleans()),
        lora_cfg=draw(optional(lora_configs())),
        attn_implementation=draw(one_of_literal(AttnImplementation)),
        release_cache_after_train=draw(st.booleans()),
        fp8=draw(optional(st.builds(Float8Config, recipe=one_of_literal(Float8Recipe)))),
    )
    reward_cfg = RewardModelConfig(reward_model_type=draw(one_of_literal(RewardModelType)))
    return PolicyConfig(
        model_name=draw(TEXT),
        tokenizer=draw(tokenizer),
        precision=draw(one_of_literal(Precision)),
        train_global_batch_size=gbs,
        train_micro_batch_size=mbs,
        logprob_batch_size=draw(st.integers(1, 64)),
        logprob_chunk_size=draw(optional(st.integers(1, 4096))),
        max_grad_norm=draw(optional(POSITIVE_FLOATS)),
        offload_optimizer_for_logprob=draw(st.booleans()),
        make_sequence_length_divisible_by=draw(st.integers(1, 128)),
        max_total_sequence_length=max_len,
        hf_config_overrides=draw(KWARGS),
        refit_buffer_size_gb=draw(optional(POSITIVE_FLOATS)),
        batch_size=draw(optional(st.integers(1, 64))),
        dtensor_cfg=dtensor,
        sequence_packing=packing,
        dynamic_batching=dynamic,
        optimizer=draw(optional(st.builds(OptimizerConfig, name=DOTTED, kwargs=KWARGS))),
        scheduler=draw(optional(scheduler_configs())),
        generation=draw(optional(generation)),
        reward_model_cfg=reward_cfg if reward else None,
        router_replay=draw(optional(st.just(RouterReplayConfig()))),
        draft=None
        if tp * cp != 1
        else draw(
            optional(
                st.builds(
                    DraftConfig,
                    model_name=optional(TEXT),
                    loss_weight=st.floats(0, 10),
                    num_layers=optional(st.integers(1, 4)),
                    aux_layer_indices=optional(
                        st.lists(st.integers(0, 64), min_size=1, max_size=3).map(tuple)
                    ),
                )
            )
        ),
    )


# --- helpers over plain trees -------------------------------------------------------------------


def dotted(path: Path) -> str:
    return "policy" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def keys_in(tree: Any, path: Path = ()) -> list[tuple[Path, str]]:
    """(parent path, key) of every key the schema owns (not keys inside free dicts)."""
    found: list[tuple[Path, str]] = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            found.append((path, key))
            if key not in FREE_DICTS:
                found += keys_in(value, (*path, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            found += keys_in(value, (*path, index))
    return found


def leaves_in(tree: Any, path: Path = ()) -> list[Path]:
    """Paths of every scalar, None section, and free dict the schema owns."""
    if isinstance(tree, dict) and (not path or path[-1] not in FREE_DICTS):
        return [leaf for key, value in tree.items() for leaf in leaves_in(value, (*path, key))]
    if isinstance(tree, list):
        return [
            leaf for index, value in enumerate(tree) for leaf in leaves_in(value, (*path, index))
        ]
    return [path]


def node_at(tree: Any, path: Path) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def replaced(tree: Any, path: Path, value: Any) -> Any:
    tree = copy.deepcopy(tree)
    node_at(tree, path[:-1])[path[-1]] = value
    return tree


def wrong_type_for(current: Any, path: Path) -> Any:
    # A mapping is wrong for every scalar/list field; a free dict needs a non-mapping instead.
    return [1, 2] if path[-1] in FREE_DICTS else {"bad": 1}


def error_lines(mapping: Any) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        with pytest.raises(ConfigError) as info:
            load_config(mapping, strict=True)
    return [line.strip() for line in str(info.value).splitlines()[1:]]


# --- round trip ---------------------------------------------------------------------------------


@settings(max_examples=60)
@given(cfg=policy_configs())
def test_unstructure_then_load_is_identity(cfg):
    """Also through JSON text (the provenance record), and with NeMo-RL's `enabled` switches:
    `{enabled: true, ...}` equals the section without `enabled`, `{enabled: false, ...}` equals
    absent."""
    plain = config_to_dict(cfg)
    assert load_config(converter.unstructure(cfg)) == cfg
    assert load_config(plain) == cfg
    assert load_config(json.loads(json.dumps(plain))) == cfg
    marked = copy.deepcopy(plain)
    for key in (
        "sequence_packing",
        "dynamic_batching",
        "reward_model_cfg",
        "router_replay",
        "draft",
    ):
        marked[key] = (
            {"enabled": False} if marked[key] is None else {"enabled": True, **marked[key]}
        )
    lora = marked["dtensor_cfg"]["lora_cfg"]
    marked["dtensor_cfg"]["lora_cfg"] = (
        {"enabled": False, "dim": 8} if lora is None else {**lora, "enabled": True}
    )
    assert load_config(marked) == cfg


# --- every problem reported with its path ---------------------------------------------------------


@settings(max_examples=40)
@given(cfg=policy_configs(), data=st.data())
def test_every_typo_is_reported_with_its_path(cfg, data):
    tree = config_to_dict(cfg)
    parent, key = data.draw(st.sampled_from(keys_in(tree)))
    node = node_at(tree, parent)
    node[f"{key}_typo"] = node.pop(key)
    lines = [
        line
        for line in error_lines(tree)
        if line.endswith(f" @ {dotted(parent)}")
        and line.startswith(f"extra fields found ({key}_typo")
    ]
    assert len(lines) == 1
    if not (parent and parent[0] == "scheduler"):  # a scheduler item without `milestones` is
        assert f"({key}_typo: did you mean " in lines[0]  # a {name, kwargs} entry


@settings(max_examples=40)
@given(cfg=policy_configs(), data=st.data())
def test_every_wrong_type_is_reported_with_its_path(cfg, data):
    tree = config_to_dict(cfg)
    path = data.draw(st.sampled_from(leaves_in(tree)))
    lines = error_lines(replaced(tree, path, wrong_type_for(node_at(tree, path), path)))
    assert any(line.endswith(f" @ {dotted(path)}") for line in lines), lines


@settings(max_examples=40)
@given(cfg=policy_configs(), data=st.data())
def test_several_problems_are_reported_at_once(cfg, data):
    tree = config_to_dict(cfg)
    paths = data.draw(
        st.lists(st.sampled_from(leaves_in(tree)), min_size=2, max_size=5, unique=True)
    )
    for path in paths:
        tree = replaced(tree, path, wrong_type_for(node_at(tree, path), path))
    lines = error_lines(tree)
    for path in paths:
        assert any(line.endswith(f" @ {dotted(path)}") for line in lines), (path, lines)


FULL: dict[str, Any] = {
    "model_name": "m",
    "dtensor_cfg": {"lora_cfg": {"target_modules": ["q_proj"]}},
    "dynamic_batching": {"train_mb_tokens": 4096},
    "generation": {"temperature": 0.7, "top_k": 20, "colocated": {"enabled": False}},
    "reward_model_cfg": {"enabled": False},
    "draft": {"model_name": "d"},
    "scheduler": [
        {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.1}},
        {"name": "torch.optim.lr_scheduler.ConstantLR"},
        {"milestones": [10]},
    ],
}

BAD_VALUES = [  # (path, value, phrase of the message)
    ("model_name", "", "must not be empty"),
    ("model_name", 3, "expected a string"),
    ("precision", "bf17", r"'bf17' is not a precision; use one of float32, bfloat16, float16"),
    ("train_global_batch_size", 0, "must be >= 1"),
    ("train_global_batch_size", "32", "expected an integer"),
    ("train_global_batch_size", 32.0, "expected an integer"),
    ("train_micro_batch_size", -1, "must be >= 1"),
    ("logprob_batch_size", True, "expected an integer"),
    ("logprob_chunk_size", 0, "must be >= 1"),
    ("max_grad_norm", 0.0, "must be > 0"),
    ("max_grad_norm", "1.0", "expected a number"),
    ("offload_optimizer_for_logprob", "false", "expected true or false"),
    ("make_sequence_length_divisible_by", 0, "must be >= 1"),
    ("max_total_sequence_length", -4, "must be >= 1"),
    ("refit_buffer_size_gb", -1.0, "must be > 0"),
    ("hf_config_overrides", [1], "expected a mapping"),
    ("tokenizer", "qwen", "expected a mapping"),
    ("tokenizer.name", "", "must not be empty"),
    ("dtensor_cfg.tensor_parallel_size", 0, "must be >= 1"),
    ("dtensor_cfg.context_parallel_size", "2", "expected an integer"),
    ("dtensor_cfg.sequence_parallel", 1, "expected true or false"),
    ("dtensor_cfg.attn_implementation", "flash_attention_2", "is not one of 'auto'"),
    ("dtensor_cfg.lora_cfg.dim", 0, "must be >= 1"),
    ("dtensor_cfg.lora_cfg.alpha", 0, "must be > 0"),
    ("dtensor_cfg.lora_cfg.dropout", 1.0, r"must be in \[0, 1\)"),
    ("dtensor_cfg.lora_cfg.dropout_position", "middle", "is not one of 'pre', 'post'"),
    ("dtensor_cfg.lora_cfg.lora_A_init", "normal", "is not one of 'xavier', 'uniform'"),
    ("dtensor_cfg.lora_cfg.target_modules", "q_proj", "expected a list"),
    ("dtensor_cfg.lora_cfg.target_modules", ["re:(unclosed"], "full-match patterns"),
    ("dtensor_cfg.lora_cfg.enabled", "yes", "enabled must be true or false"),
    ("dynamic_batching.train_mb_tokens", 0, "must be >= 1"),
    ("dynamic_batching.sequence_length_round", 0, "must be >= 1"),
    ("generation.temperature", 0.0, "must be > 0"),
    ("generation.top_p", 1.5, r"must be in \(0, 1\]"),
    ("generation.top_k", 2.5, "expected an integer"),
    ("generation.colocated.enabled", None, "expected true or false"),
    (
        "reward_model_cfg.reward_model_type",
        "pairwise",
        "is not one of 'bradley_terry', 'regression'",
    ),
    ("optimizer.name", "AdamW", "must be a dotted import path; write it like torch.optim.AdamW"),
    ("optimizer.kwargs", "lr=1", "expected a mapping"),
    ("draft.model_name", "", "must not be empty"),
    (
        "dtensor_cfg.lora_cfg.compute_dtype",
        "fp8",
        "compute_dtype = 'fp8' must be one of 'auto', 'float32', 'bfloat16', 'float16'; use 'auto'",
    ),
]


def set_dotted(tree: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    *parents, last = path.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return tree


@pytest.mark.parametrize(
    ("path", "value", "phrase"), BAD_VALUES, ids=[f"{p}={v!r}" for p, v, _ in BAD_VALUES]
)
def test_bad_value_is_reported_with_its_path_and_rule(path, value, phrase):
    tree = set_dotted(FULL, path, value)
    if path.startswith("reward_model_cfg."):
        tree["reward_model_cfg"]["enabled"] = True
    where = f"policy.{path}"
    if path.endswith("lora_cfg.enabled"):  # a section's switch is reported at the section
        where = where.removesuffix(".enabled")
    assert any(
        re.search(phrase, line) and line.endswith(f" @ {where}") for line in error_lines(tree)
    ), error_lines(tree)


@pytest.mark.parametrize("bad", [-1, 0, -1000])
def test_non_positive_budgets_and_sizes_are_rejected(bad):
    for path in (
        "train_global_batch_size",
        "dtensor_cfg.tensor_parallel_size",
        "dynamic_batching.train_mb_tokens",
        "dtensor_cfg.lora_cfg.dim",
    ):
        assert f"{path.rsplit('.', 1)[-1]} = {bad} must be >= 1 @ policy.{path}" in error_lines(
            set_dotted(FULL, path, bad)
        )


def test_scheduler_problems_carry_list_indices():
    tree = set_dotted(
        FULL,
        "scheduler",
        [
            {"name": "torch.optim.lr_scheduler.LinearLR", "kwarg": {}},
            {"nme": "x"},
            {"milestones": [5, "ten"]},
        ],
    )
    lines = error_lines(tree)
    assert "extra fields found (kwarg: did you mean 'kwargs'?) @ policy.scheduler[0]" in lines
    assert "extra fields found (nme: did you mean 'name'?) @ policy.scheduler[1]" in lines
    assert "required field missing @ policy.scheduler[1].name" in lines
    assert "expected an integer, got 'ten' (str) @ policy.scheduler[2].milestones[1]" in lines


def test_missing_model_name_and_non_mapping_sections():
    assert error_lines({}) == ["required field missing @ policy.model_name"]
    assert "expected a mapping, got 3 (int) @ policy.dtensor_cfg" in error_lines(
        {"model_name": "m", "dtensor_cfg": 3}
    )
    assert "expected a mapping or null, got [] (list) @ policy.sequence_packing" in error_lines(
        {"model_name": "m", "sequence_packing": []}
    )
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(["model_name"])  # type: ignore[arg-type]


def test_api_example_line_is_exact():
    lines = error_lines({"model_name": "m", "dtensor_cfg": {"tensor_paralel_size": 2}})
    assert lines == [
        "extra fields found (tensor_paralel_size: did you mean "
        "'tensor_parallel_size'?) @ policy.dtensor_cfg"
    ]


def test_lora_with_no_rule_or_only_excludes_loads_as_in_automodel():
    # Automodel: no rule means target_modules ["*_proj"]; only exclude_modules means "every
    # linear layer but these" (NeMo-RL's nanov3 LoRA recipes).
    bare = load_config({"model_name": "m", "dtensor_cfg": {"lora_cfg": {"enabled": True}}})
    assert bare.dtensor_cfg.lora_cfg == LoRAConfig(match_all_linear=False)
    nanov3 = load_config(
        {
            "model_name": "m",
            "dtensor_cfg": {
                "lora_cfg": {
                    "enabled": True,
                    "target_modules": [],
                    "exclude_modules": ["*out_proj*"],
                    "match_all_linear": False,
                }
            },
        }
    )
    assert nanov3.dtensor_cfg.lora_cfg is not None
    assert nanov3.dtensor_cfg.lora_cfg.exclude_modules == ("*out_proj*",)
    assert "must hold module names, wildcards" in "\n".join(
        error_lines({"model_name": "m", "dtensor_cfg": {"lora_cfg": {"target_modules": ["*(x"]}}})
    )


def test_precision_aliases_store_the_full_name():
    for alias, full in PRECISION_ALIASES.items():
        assert load_config({"model_name": "m", "precision": alias.upper()}).precision == full
    assert load_config({"model_name": "m", "precision": "torch.bfloat16"}).precision == "bfloat16"
    assert error_lines({"model_name": "m", "precision": "int8"}) == [
        "'int8' is not a precision; use one of float32, bfloat16, float16 "
        "(aliases: bf16, fp16, half, fp32, float) @ policy.precision"
    ]


def test_lora_compute_dtype_defaults_to_auto_and_takes_precision_aliases():
    def lora(**kw: Any) -> LoRAConfig | None:
        cfg = load_config({"model_name": "m", "dtensor_cfg": {"lora_cfg": kw}})
        return cfg.dtensor_cfg.lora_cfg

    assert lora() == LoRAConfig(compute_dtype="auto")
    assert lora(compute_dtype="bf16") == LoRAConfig(compute_dtype="bfloat16")
    assert lora(compute_dtype="torch.float32") == LoRAConfig(compute_dtype="float32")
    with pytest.raises(ValueError, match="compute_dtype = 'int8' must be one of 'auto'"):
        LoRAConfig(compute_dtype="int8")  # pyright: ignore[reportArgumentType]


def test_a_disabled_section_still_rejects_a_typo_but_not_its_values():
    cfg = load_config(
        {"model_name": "m", "sequence_packing": {"enabled": False, "train_mb_tokens": "x"}}
    )
    assert not cfg.sequence_packing_enabled
    assert error_lines(
        {"model_name": "m", "sequence_packing": {"enabled": False, "algoritm": "x"}}
    ) == ["extra fields found (algoritm: did you mean 'algorithm'?) @ policy.sequence_packing"]


# --- NeMo-RL keys this worker does not read ----------------------------------------------------

BASE_FOR_IGNORED = {
    "model_name": "m",
    "dtensor_cfg": {},
    "sequence_packing": {"enabled": False},
    "draft": {"enabled": False},
    "generation": {"colocated": {"enabled": True}},
}


def _accepted_not_used(caplog) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "policyworker" and "accepted, not used" in r.getMessage()
    ]


@pytest.mark.parametrize("path", sorted(IGNORED_NEMO_RL_KEYS))
def test_ignored_nemo_rl_key_is_listed_once_at_info_and_changes_nothing(path, caplog):
    expected = load_config(BASE_FOR_IGNORED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        with caplog.at_level(logging.INFO, logger="policyworker"):
            cfg = load_config(set_dotted(BASE_FOR_IGNORED, path, {"anything": [1, 2]}))
    assert cfg == expected
    records = _accepted_not_used(caplog)
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert f"policy.{path}" in records[0].getMessage()


def test_all_ignored_keys_are_listed_in_one_record(caplog):
    tree: dict[str, Any] = BASE_FOR_IGNORED
    for path in IGNORED_NEMO_RL_KEYS:
        tree = set_dotted(tree, path, 1)
    with caplog.at_level(logging.INFO, logger="policyworker"):
        load_config(tree)
    records = _accepted_not_used(caplog)
    assert len(records) == 1
    assert all(f"policy.{path}" in records[0].getMessage() for path in IGNORED_NEMO_RL_KEYS)


@pytest.mark.parametrize(
    ("tree", "line"),
    [
        ({"generation": {"temperatur": 1.0}}, "temperatur: did you mean 'temperature'?"),
        ({"generation": {"val_top_kk": 1}}, "val_top_kk: did you mean 'val_top_k'?"),
        (
            {"draft": {"enabled": False, "loss_wieght": 1}},
            "loss_wieght: did you mean 'loss_weight'?",
        ),
        ({"tokenizer": {"use_fastokenz": True}}, "use_fastokenz: did you mean 'use_fastokens'?"),
        ({"dtensor_cfg": {"lora_cfg": {"enabled": True, "dims": 3}}}, "dims: did you mean 'dim'?"),
        ({"quant_cfgg": None}, "quant_cfgg: did you mean 'quant_cfg'?"),
        ({"zzz_unrelated": 1}, "extra fields found (zzz_unrelated) @ policy"),
    ],
)
def test_a_key_nemo_rl_does_not_define_is_an_error_with_a_did_you_mean(tree, line):
    with pytest.raises(ConfigError) as info:
        load_config({"model_name": "m", **tree}, strict=True)
    assert line in str(info.value)


@settings(max_examples=30)
@given(cfg=policy_configs(), subset=st.sets(st.sampled_from(sorted(IGNORED_NEMO_RL_KEYS))))
def test_split_ignored_keys_recovers_the_config_and_is_pure(cfg, subset):
    clean = config_to_dict(cfg)
    tree = clean
    inserted = set()
    for path in subset:
        parent: Any = tree
        for part in path.split(".")[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if isinstance(parent, dict):  # only where the parent section exists
            tree = set_dotted(tree, path, {"x": 1})
            inserted.add(path)
    before = copy.deepcopy(tree)
    kept, found = split_ignored_keys(tree)
    assert kept == clean
    assert tree == before
    assert set(found) == inserted


def test_known_worker_keys_are_never_in_the_ignore_table():
    owned = (
        {a.name for a in attrs.fields(PolicyConfig)}
        | {f"dtensor_cfg.{a.name}" for a in attrs.fields(DTensorConfig)}
        | {f"generation.{a.name}" for a in attrs.fields(GenerationConfig)}
    )
    assert not owned & set(IGNORED_NEMO_RL_KEYS)


# --- cross-field rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patch", "phrase"),
    [
        (
            {
                "sequence_packing": {"train_mb_tokens": 64},
                "dynamic_batching": {"train_mb_tokens": 64},
            },
            r"both enabled but are exclusive; set enabled: false on one of them "
            r"@ policy\.sequence_packing",
        ),
        (
            {
                "sequence_packing": {"train_mb_tokens": 64},
                "dtensor_cfg": {"context_parallel_size": 2},
            },
            r"does not support dtensor_cfg\.context_parallel_size > 1 \(got 2\); "
            r"set context_parallel_size: 1",
        ),
        (
            {
                "sequence_packing": {"train_mb_tokens": 64},
                "reward_model_cfg": {"reward_model_type": "regression"},
            },
            r"not supported for reward models .*; disable sequence_packing "
            r"@ policy\.sequence_packing",
        ),
        (
            {"train_global_batch_size": 30, "train_micro_batch_size": 4},
            r"train_global_batch_size = 30 must be a multiple of "
            r"train_micro_batch_size = 4; change one",
        ),
        (
            {"max_total_sequence_length": 10, "dtensor_cfg": {"context_parallel_size": 2}},
            r"max_total_sequence_length = 10 must be divisible by "
            r"2 \* dtensor_cfg\.context_parallel_size = 4 "
            r"\(load-balanced CP chunks\); use 12 @ policy\.max_total_sequence_length",
        ),
        (
            {"sequence_packing": {}},
            r"required field missing @ policy\.sequence_packing\.train_mb_tokens",
        ),
        (
            {"dynamic_batching": {"enabled": True}},
            r"required field missing @ policy\.dynamic_batching\.train_mb_tokens",
        ),
        (
            {"scheduler": [{"name": "a.B"}, {"name": "a.C"}]},
            r"2 schedulers need 1 milestones, got \[\]; add one \{milestones: \[...\]\} item",
        ),
        (
            {"scheduler": [{"name": "a.B"}, {"name": "a.C"}, {"milestones": [0]}]},
            r"milestones \[0\] must be strictly increasing positive step counts "
            r"@ policy\.scheduler$",
        ),
        (
            {"scheduler": [{"name": "a.B"}, {"milestones": []}, {"milestones": []}]},
            r"a second \{milestones: \[...\]\} item; keep exactly one @ policy\.scheduler\[2\]",
        ),
        ({"scheduler": []}, r"has no \{name, kwargs\} entry; add one or omit scheduler"),
        (
            {"draft": {}, "dtensor_cfg": {"tensor_parallel_size": 2}},
            r"needs dtensor_cfg\.tensor_parallel_size = 1 and context_parallel_size = 1 "
            r"\(got 2 and 1\); use data parallelism only, or remove the draft @ policy\.draft",
        ),
        (
            {"draft": {}, "dtensor_cfg": {"context_parallel_size": 2}},
            r"\(got 1 and 2\); use data parallelism only",
        ),
    ],
)
def test_cross_field_rule_message_states_the_fix(patch, phrase):
    with pytest.raises(ConfigError, match=re.compile(phrase, re.M)):
        load_config({"model_name": "m", **patch})


def test_cross_field_problems_are_all_reported():
    lines = error_lines(
        {
            "model_name": "m",
            "train_global_batch_size": 30,
            "train_micro_batch_size": 4,
            "max_total_sequence_length": 10,
            "dtensor_cfg": {"context_parallel_size": 2},
            "sequence_packing": {"train_mb_tokens": 8},
            "dynamic_batching": {"train_mb_tokens": 8},
        }
    )
    assert [line.rsplit(" @ ", 1)[1] for line in lines] == [
        "policy.sequence_packing",
        "policy.sequence_packing",
        "policy.max_total_sequence_length",
    ]


def test_micro_batch_rule_applies_to_fixed_microbatching_only():
    cfg = load_config(
        {
            "model_name": "m",
            "train_global_batch_size": 30,
            "train_micro_batch_size": 4,
            "dynamic_batching": {"train_mb_tokens": 128},
        }
    )
    assert not cfg.fixed_microbatching
    validate_for_world(cfg, dp_size=3)
    with pytest.raises(
        ConfigError, match=r"multiple of dp_size = 4 .*@ policy\.train_global_batch_size"
    ):
        validate_for_world(cfg, dp_size=4)


@given(
    mbs=st.integers(1, 8), dp_size=st.integers(1, 8), k=st.integers(1, 8), off=st.integers(0, 63)
)
def test_validate_for_world_accepts_exactly_whole_microbatches_per_rank(mbs, dp_size, k, off):
    gbs = mbs * k * (off + 1)
    cfg = PolicyConfig(model_name="m", train_global_batch_size=gbs, train_micro_batch_size=mbs)
    if gbs % (dp_size * mbs) == 0:
        validate_for_world(cfg, dp_size=dp_size)
    else:
        with pytest.raises(
            ConfigError,
            match=rf"train_global_batch_size = {gbs} must be a multiple of "
            rf"dp_size \* train_micro_batch_size = {dp_size} \* {mbs}",
        ):
            validate_for_world(cfg, dp_size=dp_size)


def test_validate_for_world_rejects_a_bad_dp_size():
    with pytest.raises(ValueError, match="dp_size = 0 must be >= 1"):
        validate_for_world(PolicyConfig(model_name="m"), dp_size=0)


def test_sequence_parallel_without_tp_is_only_a_warning():
    with pytest.warns(
        ConfigWarning, match="sequence_parallel is true but tensor_parallel_size is 1"
    ):
        cfg = load_config({"model_name": "m", "dtensor_cfg": {"sequence_parallel": True}})
    assert cfg.dtensor_cfg.sequence_parallel
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(
            {
                "model_name": "m",
                "dtensor_cfg": {"sequence_parallel": True, "tensor_parallel_size": 2},
            }
        )


def test_direct_construction_enforces_the_same_rules():
    with pytest.raises(ValueError, match="train_micro_batch_size = 0 must be >= 1"):
        PolicyConfig(model_name="m", train_micro_batch_size=0)
    with pytest.raises(
        ConfigError,
        match=r"must be a multiple of train_micro_batch_size = 4; change one of "
        r"them @ policy\.train_global_batch_size",
    ):
        PolicyConfig(model_name="m", train_global_batch_size=6, train_micro_batch_size=4)


# --- defaults and normalisations ----------------------------------------------------------------


def test_defaults_follow_the_api():
    cfg = load_config({"model_name": "org/model"})
    assert (cfg.train_global_batch_size, cfg.train_micro_batch_size, cfg.logprob_batch_size) == (
        32,
        1,
        8,
    )
    assert (
        cfg.precision == "bfloat16" and cfg.max_grad_norm == 1.0 and cfg.logprob_chunk_size is None
    )
    assert cfg.optimizer == OptimizerConfig(
        name="torch.optim.AdamW", kwargs={"lr": 1e-5, "weight_decay": 0.01}
    )
    assert cfg.scheduler is None and cfg.generation is None and cfg.hf_config_overrides == {}
    assert cfg.tokenizer_name == "org/model" and cfg.make_sequence_length_divisible_by == 1
    assert cfg.dtensor_cfg == DTensorConfig()
    assert cfg.dtensor_cfg.attn_implementation == "auto"
    assert not any(
        [
            cfg.sequence_packing_enabled,
            cfg.dynamic_batching_enabled,
            cfg.lora_enabled,
            cfg.reward_model_enabled,
            cfg.router_replay_enabled,
            cfg.draft_enabled,
        ]
    )
    lora = load_config(
        {"model_name": "m", "dtensor_cfg": {"lora_cfg": {"enabled": True}}}
    ).dtensor_cfg.lora_cfg
    assert lora == LoRAConfig() and (lora.dim, lora.alpha, lora.dropout, lora.use_rslora) == (
        8,
        32.0,
        0.0,
        False,
    )


def test_normalisations_nulls_and_vllm_spellings():
    cfg = load_config(
        {
            "model_name": "m",
            "hf_config_overrides": None,
            "optimizer": None,
            "generation": {"top_k": -1},
            "router_replay": {"enabled": True},
            "scheduler": {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0}},
        }
    )
    assert cfg.hf_config_overrides == {} and cfg.optimizer is None and cfg.router_replay_enabled
    assert cfg.generation == GenerationConfig(top_k=None)
    assert (
        load_config({"model_name": "m", "generation": {"top_k": 0}}).generation
        == GenerationConfig()
    )
    assert cfg.scheduler == SchedulerConfig(
        entries=(
            SchedulerEntry(name="torch.optim.lr_scheduler.ConstantLR", kwargs={"factor": 1.0}),
        )
    )
    assert config_to_dict(cfg)["scheduler"] == {
        "name": "torch.optim.lr_scheduler.ConstantLR",
        "kwargs": {"factor": 1.0},
    }


def test_yarn_rope_scaling_is_allowed():
    overrides = {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
        }
    }
    assert (
        load_config({"model_name": "m", "hf_config_overrides": overrides}).hf_config_overrides
        == overrides
    )


def test_token_budgets_default_logprob_to_train():
    cfg = load_config({"model_name": "m", "sequence_packing": {"train_mb_tokens": 100}})
    assert cfg.sequence_packing is not None and cfg.sequence_packing.logprob_tokens == 100
    cfg = load_config(
        {"model_name": "m", "dynamic_batching": {"train_mb_tokens": 100, "logprob_mb_tokens": 7}}
    )
    assert cfg.dynamic_batching is not None and cfg.dynamic_batching.logprob_tokens == 7

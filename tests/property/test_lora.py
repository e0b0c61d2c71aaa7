import math
import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policyworker.errors import LoRAMergeError
from policyworker.functional.lora import (
    assert_lora_modules_reachable,
    from_peft_key,
    lora_delta,
    lora_param_names,
    lora_scale,
    lora_shard_dims,
    matches_entry,
    matches_target,
    merge_lora_weight,
    to_peft_key,
    unmatched_entries,
    unmerge_lora_weight,
    validate_target_entries,
    wildcard_regex,
)
from tests.property.strategies import FLOAT_DTYPES, SEEDS, seeded_randn

dims = st.integers(1, 24)
ranks = st.integers(1, 8)
alphas = st.floats(0.5, 64)
SEGMENTS = st.sampled_from(
    [
        "model",
        "layers",
        "0",
        "1",
        "self_attn",
        "q_proj",
        "v_proj",
        "mlp",
        "up_proj",
        "lm_head",
        "proj",
        "q",
        "x",
    ]
)
module_names = st.lists(SEGMENTS, min_size=1, max_size=5).map(".".join)
# a merge of factors whose dtypes may differ from the base weight's
MIXED_DTYPE_MERGES = dict(
    d_in=dims,
    d_out=dims,
    rank=ranks,
    seed=SEEDS,
    dtype=FLOAT_DTYPES,
    ab_dtype=FLOAT_DTYPES,
    alpha=alphas,
)


def _factors(seed, d_out, d_in, rank, dtype=torch.float64):
    W = seeded_randn(seed, (d_out, d_in), dtype)
    A = seeded_randn(seed + 1, (rank, d_in), dtype)
    B = seeded_randn(seed + 2, (d_out, rank), dtype)
    return W, A, B


@given(
    d_in=dims,
    d_out=dims,
    rank=ranks,
    batch=st.integers(1, 4),
    alpha=alphas,
    seed=SEEDS,
    rslora=st.booleans(),
)
@example(
    d_in=1, d_out=8, rank=2, batch=1, alpha=8.0, seed=0, rslora=False
)  # the float64 down-cast bug
def test_merged_forward_equals_unmerged_forward(d_in, d_out, rank, batch, alpha, seed, rslora):
    W, A, B = _factors(seed, d_out, d_in, rank)
    x = seeded_randn(seed + 3, (batch, d_in), torch.float64)
    scale = lora_scale(alpha, rank, rslora)
    unmerged = x @ W.T + scale * (x @ A.T) @ B.T
    merged = merge_lora_weight(W, A, B, scale)
    assert merged.dtype == torch.float64
    torch.testing.assert_close(x @ merged.T, unmerged)


@given(d_in=dims, d_out=dims, rank=ranks, alpha=alphas, seed=SEEDS)
def test_unmerge_inverts_merge(d_in, d_out, rank, alpha, seed):
    W, A, B = _factors(seed, d_out, d_in, rank)
    scale = lora_scale(alpha, rank)
    torch.testing.assert_close(
        unmerge_lora_weight(merge_lora_weight(W, A, B, scale), A, B, scale), W
    )


@given(d_in=dims, d_out=dims, rank=ranks, seed=SEEDS, s1=st.floats(-4, 4), s2=st.floats(-4, 4))
def test_merge_delta_is_linear_in_scale(d_in, d_out, rank, seed, s1, s2):
    W, A, B = _factors(seed, d_out, d_in, rank)
    d1 = merge_lora_weight(W, A, B, s1) - W
    d2 = merge_lora_weight(W, A, B, s2) - W
    torch.testing.assert_close(merge_lora_weight(W, A, B, s1 + s2) - W, d1 + d2)
    torch.testing.assert_close(d1, lora_delta(A, B, s1, dtype=torch.float64))


@given(**MIXED_DTYPE_MERGES)
def test_zero_lora_b_leaves_weight_bit_identical(d_in, d_out, rank, seed, dtype, ab_dtype, alpha):
    W = seeded_randn(seed, (d_out, d_in), dtype)
    A = seeded_randn(seed + 1, (rank, d_in), ab_dtype)
    B = torch.zeros(d_out, rank, dtype=ab_dtype)
    merged = merge_lora_weight(W, A, B, lora_scale(alpha, rank))
    assert merged.dtype == dtype
    assert torch.equal(merged, W)
    assert merged.data_ptr() != W.data_ptr()  # a new tensor, never an alias of the live weight


@given(d_in=dims, d_out=dims, rank=ranks, seed=SEEDS, dtype=FLOAT_DTYPES, ab_dtype=FLOAT_DTYPES)
def test_merge_keeps_weight_dtype_and_does_not_mutate(d_in, d_out, rank, seed, dtype, ab_dtype):
    W, A, B = (
        t.to(dtype if i == 0 else ab_dtype) for i, t in enumerate(_factors(seed, d_out, d_in, rank))
    )
    before = W.clone()
    merged = merge_lora_weight(W, A, B, 0.5)
    assert merged.dtype == dtype and merged.shape == W.shape
    assert torch.equal(W, before)
    assert lora_delta(A, B, 0.5, dtype=dtype).dtype == dtype


@given(
    d_in=dims,
    d_out=dims,
    rank=ranks,
    seed=SEEDS,
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_low_precision_merge_rounds_once_from_fp32(d_in, d_out, rank, seed, dtype):
    """bf16/fp16 merges equal the fp32 merge rounded once.

    Accumulation never happens in low precision.
    """
    W, A, B = _factors(seed, d_out, d_in, rank, torch.float32)
    W = W.to(dtype)
    expected = merge_lora_weight(W.float(), A, B, 0.25).to(dtype)
    torch.testing.assert_close(merge_lora_weight(W, A, B, 0.25), expected, rtol=0, atol=0)


@given(
    d_in=dims,
    d_out=dims,
    rank=ranks,
    seed=SEEDS,
    num_shards=st.integers(1, 4),
    base_dim=st.sampled_from([None, 0, 1]),
)
def test_adapter_shards_follow_base_layout(d_in, d_out, rank, seed, num_shards, base_dim):
    """Sharding A/B per lora_shard_dims makes each rank's local B@A the same shard as its W
    shard."""
    _, A, B = _factors(seed, d_out, d_in, rank)
    a_dim, b_dim = lora_shard_dims(base_dim)
    full = B @ A
    for k in range(num_shards):
        A_k = A.tensor_split(num_shards, dim=a_dim)[k] if a_dim is not None else A
        B_k = B.tensor_split(num_shards, dim=b_dim)[k] if b_dim is not None else B
        expected = full.tensor_split(num_shards, dim=base_dim)[k] if base_dim is not None else full
        torch.testing.assert_close(B_k @ A_k, expected)


def test_lora_shard_dims_rejects_3d_dims():
    with pytest.raises(ValueError, match="shard dim 2"):
        lora_shard_dims(2)


@given(alpha=alphas, dim=st.integers(1, 512))
def test_lora_scale_matches_definition(alpha, dim):
    assert lora_scale(alpha, dim) == alpha / dim
    assert math.isclose(lora_scale(alpha, dim, use_rslora=True), alpha / math.sqrt(dim))
    assert lora_scale(2 * alpha, dim) == pytest.approx(2 * lora_scale(alpha, dim))


@pytest.mark.parametrize("dim", [0, -3, 2.5, True])
def test_lora_scale_rejects_bad_dim(dim):
    with pytest.raises(ValueError, match="lora_cfg.dim"):
        lora_scale(32, dim)


def test_mismatched_shapes_are_rejected_with_shapes():
    W, A, B = _factors(0, 4, 3, 2)
    with pytest.raises(ValueError, match=r"lora_a \(2, 3\) and lora_b \(4, 3\)"):
        merge_lora_weight(W, A, seeded_randn(9, (4, 3), torch.float64), 1.0)
    with pytest.raises(ValueError, match=r"base weight shape \(3, 4\)"):
        merge_lora_weight(W.T, A, B, 1.0)


@given(name=module_names)
def test_peft_key_round_trip(name):
    for param in lora_param_names(name):
        key = to_peft_key(param)
        assert key.startswith("base_model.model.") and key.endswith(
            ("lora_A.weight", "lora_B.weight")
        )
        assert from_peft_key(key) == param
        assert to_peft_key(from_peft_key(key)) == key


def test_from_peft_key_rejects_foreign_layout():
    with pytest.raises(ValueError, match="must start with 'base_model.model.'"):
        from_peft_key("model.layers.0.q_proj.lora_A.weight")


def _suffix_oracle(name, entry):
    parts, want = name.split("."), entry.split(".")
    return parts[-len(want) :] == want


@given(name=module_names, entry=module_names)
def test_plain_entry_matches_by_dotted_suffix(name, entry):
    assert matches_entry(name, entry) == _suffix_oracle(name, entry)
    # the same rule written as a full-match regex agrees
    assert matches_entry(name, rf"re:(.*\.)?{re.escape(entry)}") == _suffix_oracle(name, entry)


@given(name=module_names, cut=st.integers(1, 10))
def test_regex_entry_is_a_full_match(name, cut):
    prefix = name[: max(1, len(name) - cut)]
    assert matches_entry(name, "re:" + re.escape(name))
    assert matches_entry(name, "re:" + re.escape(prefix)) == (prefix == name)
    assert matches_entry(name, "re:" + re.escape(prefix) + ".*")


@given(
    name=module_names,
    targets=st.lists(module_names, max_size=3),
    excludes=st.lists(module_names, max_size=2),
    match_all=st.booleans(),
)
def test_matches_target_against_oracle(name, targets, excludes, match_all):
    # Automodel's precedence: match_all_linear, then target_modules, then "all linear but the
    # excluded"; with no rule at all, target_modules is ["*_proj"]. Excludes always win here.
    excluded = any(_suffix_oracle(name, e) for e in excludes)
    if match_all:
        selected = name.split(".")[-1] != "lm_head"
    elif targets:
        selected = any(_suffix_oracle(name, t) for t in targets)
    elif excludes:
        selected = True
    else:
        selected = name.endswith("_proj")
    assert matches_target(name, targets, excludes, match_all_linear=match_all) == (
        selected and not excluded
    )


# (pattern, module name, Automodel's wildcard_match result): the rule of its ModuleMatcher.
AUTOMODEL_WILDCARD_CASES = [
    ("*.layers.0.*.linear_qkv", "decoder.layers.0.self_attention.linear_qkv", True),
    ("*.layers.0.*.linear_qkv", "decoder.layers.1.self_attention.linear_qkv", False),
    ("*_proj", "model.layers.0.self_attn.q_proj", True),
    ("*_proj", "model.layers.0.mlp.down_proj", True),
    ("*_proj", "lm_head", False),
    ("*_proj", "model.layers.0.self_attn.q_proj_norm", False),
    ("*out_proj*", "backbone.layers.3.mixer.out_proj", True),
    ("*out_proj*", "backbone.layers.3.mixer.in_proj", False),
    ("*.lm_head", "model.lm_head", True),
    ("*.lm_head", "lm_head", False),
    ("model.*.q_proj", "model.layers.7.self_attn.q_proj", True),
    ("*.mlp.*", "model.layers.0.mlp.up_proj", True),
    ("*.mlp.*", "model.layers.0.self_attn.o_proj", False),
]


@pytest.mark.parametrize(("pattern", "name", "expected"), AUTOMODEL_WILDCARD_CASES)
def test_wildcards_follow_automodels_table(pattern, name, expected):
    assert matches_entry(name, pattern) == expected
    assert (re.match(wildcard_regex(pattern), name) is not None) == expected


# (target_modules, exclude_modules, match_all_linear) -> the modules adapted in a small decoder
DECODER = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp.up_proj",
    "backbone.layers.0.mixer.out_proj",
    "lm_head",
]
AUTOMODEL_SELECTION_CASES = [
    (([], [], False), DECODER[:4]),  # no rule: Automodel's default target "*_proj"
    (([], ["*out_proj*"], False), [DECODER[0], DECODER[1], DECODER[2], "lm_head"]),  # nanov3
    (([], [], True), DECODER[:4]),  # all linear but the output head (see matches_target)
    ((["*_proj"], [], False), DECODER[:4]),
    ((["q_proj", "up_proj"], [], False), [DECODER[0], DECODER[2]]),
    ((["*.mlp.*"], [], False), [DECODER[2]]),
    ((["re:.*\\.self_attn\\..*"], [], False), DECODER[:2]),
]


@pytest.mark.parametrize(("rule", "expected"), AUTOMODEL_SELECTION_CASES)
def test_selection_follows_automodels_table(rule, expected):
    targets, excludes, match_all = rule
    assert [
        n for n in DECODER if matches_target(n, targets, excludes, match_all_linear=match_all)
    ] == expected


@given(name=module_names, stem=st.sampled_from(["proj", "q", "mlp", "layers"]))
def test_a_star_spans_any_text_of_a_name(name, stem):
    assert matches_entry(name, "*") is True
    assert matches_entry(name, f"*{stem}*") == (stem in name)
    assert matches_entry(name, f"*{stem}") == name.endswith(stem)


@given(names=st.lists(module_names, max_size=6), entries=st.lists(module_names, max_size=4))
def test_unmatched_entries_are_those_matching_nothing(names, entries):
    got = unmatched_entries(names, entries)
    assert got == [e for e in entries if not any(_suffix_oracle(n, e) for n in names)]


def test_examples_of_the_matching_rule():
    assert matches_entry("model.layers.0.self_attn.q_proj", "q_proj")
    assert matches_entry("model.layers.0.self_attn.q_proj", "self_attn.q_proj")
    assert not matches_entry("model.layers.0.self_attn.q_proj", "proj")
    assert not matches_entry("model.layers.0.self_attn.q_proj", "re:q_proj")
    assert matches_entry("model.layers.0.self_attn.q_proj", r"re:.*\.layers\.0\..*_proj")
    assert not matches_target("lm_head", [], [], match_all_linear=True)
    assert not matches_target(
        "model.layers.0.mlp.up_proj", ["up_proj"], ["re:.*layers\\.0\\..*"], match_all_linear=False
    )


@pytest.mark.parametrize(
    ("entries", "phrase"),
    [
        (["q_proj", ""], "non-empty"),
        (["re:(q"], "not a valid regex"),
        (["*_proj", "*(q"], "not a valid regex"),
    ],
)
def test_validate_target_entries_names_the_bad_entry(entries, phrase):
    with pytest.raises(ValueError, match=f"lora_cfg.target_modules entry .*{phrase}"):
        validate_target_entries(entries, what="lora_cfg.target_modules")


@settings(max_examples=30)
@given(names=st.lists(module_names, min_size=1, max_size=6, unique=True), data=st.data())
def test_unreachable_lora_modules_are_all_named(names, data):
    dropped = data.draw(st.lists(st.sampled_from(names), unique=True))
    keys = [f"{n}.weight" for n in names if n not in dropped] + [
        p for n in names for p in lora_param_names(n)
    ]
    if not dropped:
        assert_lora_modules_reachable(names, keys)
        return
    with pytest.raises(LoRAMergeError) as info:
        assert_lora_modules_reachable(names, keys)
    message = str(info.value)
    assert f"{len(dropped)} LoRA module(s)" in message
    for name in dropped:
        assert f"{name!r}: no key" in message
    positions = [message.index(f"{n!r}: no key") for n in sorted(dropped)]
    assert positions == sorted(positions)


def test_renamed_module_error_points_at_the_close_key():
    keys = ["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(
        LoRAMergeError, match=r"_orig_mod\.model\.layers\.0\.self_attn\.q_proj.*closest key"
    ):
        assert_lora_modules_reachable(["_orig_mod.model.layers.0.self_attn.q_proj"], keys)

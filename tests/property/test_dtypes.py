"""Properties of policyworker.functional.dtypes: precision names and the refit dtype rule."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.dtypes import (
    PRECISION_NAMES,
    decode_refit_info,
    encode_refit_info,
    name_matches_pattern,
    precision_dtype,
    refit_tensor_dtype,
)

ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
TARGETS = [torch.bfloat16, torch.float16, torch.float32]
components = st.sampled_from(
    ["model", "layers", "3", "mlp", "gate", "gate_proj", "weight", "bias", "experts"]
)
fqns = st.lists(components, min_size=1, max_size=6).map(".".join)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("torch.float16", torch.float16),
        ("BF16", torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_precision_names_map_to_dtypes(name, expected):
    assert precision_dtype(name) == expected


@pytest.mark.parametrize("name", ["float33", "int8", "", "torch.float64", torch.float64])
def test_unknown_precision_lists_the_choices(name):
    with pytest.raises(
        ValueError, match=r"precision .* is not supported; choose one of float32, bfloat16, float16"
    ):
        precision_dtype(name)


@given(name=st.sampled_from(PRECISION_NAMES))
def test_precision_dtype_is_idempotent_through_its_string(name):
    dtype = precision_dtype(name)
    assert precision_dtype(str(dtype)) == dtype


# (fqn, tensor dtype, default, keep_fp32) -> expected: the table oracle of API §7.
TABLE = [
    ("model.embed_tokens.weight", torch.float32, torch.bfloat16, (), torch.bfloat16),
    (
        "model.layers.0.mlp.gate.e_score_correction_bias",
        torch.float32,
        torch.bfloat16,
        (),
        torch.float32,
    ),
    (
        "model.layers.0.mlp.gate.e_score_correction_bias",
        torch.bfloat16,
        torch.float16,
        (),
        torch.float16,
    ),
    (
        "model.layers.3.mlp.gate.weight",
        torch.float32,
        torch.bfloat16,
        ("gate.weight",),
        torch.float32,
    ),
    (
        "model.layers.3.mlp.gate_proj.weight",
        torch.float32,
        torch.bfloat16,
        ("gate.weight",),
        torch.bfloat16,
    ),
    ("model.layers.3.mlp.gate.weight", torch.float32, torch.bfloat16, ("gate",), torch.float32),
    (
        "model.layers.3.mlp.gate_proj.weight",
        torch.float32,
        torch.bfloat16,
        ("gate",),
        torch.bfloat16,
    ),
    (
        "model.layers.3.mlp.gate.weight",
        torch.bfloat16,
        torch.float16,
        ("gate.weight",),
        torch.float16,
    ),
    ("gate.weight", torch.float32, torch.bfloat16, ("gate.weight",), torch.float32),
    ("model.layers.3.mlp.gate.weight", torch.float32, torch.float32, (), torch.float32),
    (
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        torch.float64,
        torch.bfloat16,
        (),
        torch.bfloat16,
    ),
    ("position_ids", torch.int64, torch.bfloat16, (), torch.int64),
    ("mask", torch.bool, torch.float16, ("mask",), torch.bool),
    ("model.layers.3.mlp.gate.weight", torch.float32, torch.bfloat16, "gate.weight", torch.float32),
]


@pytest.mark.parametrize(("fqn", "dtype", "default", "keep", "expected"), TABLE)
def test_refit_dtype_table(fqn, dtype, default, keep, expected):
    assert refit_tensor_dtype(fqn, torch.zeros(2, dtype=dtype), default, keep_fp32=keep) == expected


@given(
    fqn=fqns,
    dtype=st.sampled_from(ALL_DTYPES),
    default=st.sampled_from(TARGETS),
    keep=st.lists(fqns, max_size=3),
)
def test_refit_dtype_is_idempotent(fqn, dtype, default, keep):
    """Casting to the chosen dtype and asking again gives the same dtype."""
    once = refit_tensor_dtype(fqn, torch.zeros(1, dtype=dtype), default, keep_fp32=keep)
    twice = refit_tensor_dtype(fqn, torch.zeros(1, dtype=once), default, keep_fp32=keep)
    assert twice == once


@given(
    fqn=fqns,
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]),
    default=st.sampled_from(TARGETS),
    keep=st.lists(fqns, max_size=3),
)
def test_integer_and_bool_tensors_are_never_cast(fqn, dtype, default, keep):
    assert refit_tensor_dtype(fqn, torch.zeros(1, dtype=dtype), default, keep_fp32=keep) == dtype


@given(
    fqn=fqns,
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    default=st.sampled_from(TARGETS),
    keep=st.lists(fqns, max_size=3),
)
def test_floating_tensors_get_default_or_stay_fp32(fqn, dtype, default, keep):
    got = refit_tensor_dtype(fqn, torch.zeros(1, dtype=dtype), default, keep_fp32=keep)
    kept = dtype == torch.float32 and (
        fqn.endswith("e_score_correction_bias") or any(name_matches_pattern(fqn, p) for p in keep)
    )
    assert got == (torch.float32 if kept else default)


@given(
    prefix=st.lists(components, max_size=3),
    pattern=st.lists(components, min_size=1, max_size=3),
    suffix=st.lists(components, max_size=3),
)
def test_pattern_matches_any_dotted_component_window(prefix, pattern, suffix):
    assert name_matches_pattern(".".join(prefix + pattern + suffix), ".".join(pattern))


@pytest.mark.parametrize(
    ("fqn", "pattern", "expected"),
    [
        ("model.layers.3.mlp.gate.weight", "gate.weight", True),
        ("model.layers.3.mlp.gate_proj.weight", "gate.weight", False),
        ("model.layers.3.mlp.gate_proj.weight", "gate", False),
        ("model.layers.3.mlp.gate.weight", "mlp.gate", True),
        ("model.layers.3.mlp.gate.weight", "layers.3", True),
        ("model.layers.13.mlp.gate.weight", "layers.3", False),
        ("xgate.weight", "gate.weight", False),
    ],
)
def test_pattern_matching_examples(fqn, pattern, expected):
    assert name_matches_pattern(fqn, pattern) is expected


def test_non_floating_default_dtype_is_rejected():
    with pytest.raises(ValueError, match="default_dtype torch.int64 .* must be a floating dtype"):
        refit_tensor_dtype("w", torch.zeros(1), torch.int64)


refit_infos = st.dictionaries(
    fqns,
    st.tuples(st.lists(st.integers(0, 4096), max_size=4), st.sampled_from(ALL_DTYPES)),
    max_size=6,
)


@given(info=refit_infos)
def test_refit_info_round_trips_through_json(info):
    import json

    info = {name: (torch.Size(shape), dtype) for name, (shape, dtype) in info.items()}
    wire = json.loads(json.dumps(encode_refit_info(info)))
    decoded = decode_refit_info(wire)
    assert decoded == info
    assert list(decoded) == list(info)  # send order kept


@pytest.mark.parametrize("entry", [[[2, 3], "float33"], [[2, 3], "Size"], [[2]], "bf16"])
def test_decode_refit_info_names_the_bad_entry(entry):
    with pytest.raises(ValueError, match=r"refit_info\['w'\]"):
        decode_refit_info({"w": entry})

from hypothesis import example, given
from hypothesis import strategies as st

from policyworker.functional.float8_training import (
    DIM_MULTIPLE,
    MIN_CAPABILITY,
    LinearSpec,
    float8_plan,
    float8_unsupported_reason,
    version_tuple,
)

PREFIXES = ("model.layers.0", "model.layers.1")
NAMES = st.sampled_from(
    [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.10.mlp.up_proj",  # not layer 1: a prefix must end at a dot
        "model.layers.0.mlp.gate",  # a MoE router
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.attn.fp32_proj",  # kept in fp32 by the model
        "lm_head",
        "model.embed_tokens",
        "score",
    ]
)
DIMS = st.one_of(st.integers(1, 64), st.integers(1, 8).map(lambda k: DIM_MULTIPLE * k))


@st.composite
def linear_lists(draw):
    names = draw(st.lists(NAMES, unique=True, max_size=6))
    return tuple(
        LinearSpec(
            name=n, in_features=draw(DIMS), out_features=draw(DIMS), lora=draw(st.booleans())
        )
        for n in names
    )


KEEP = ("fp32_proj",)


def _qualifies(spec: LinearSpec) -> bool:
    return (
        any(spec.name.startswith(p + ".") for p in PREFIXES)
        and not spec.name.endswith((".gate", ".fp32_proj"))
        and spec.in_features % 16 == 0
        and spec.out_features % 16 == 0
    )


@given(linears=linear_lists())
def test_plan_partitions_the_linears_by_the_rules(linears):
    """Every linear lands in exactly one of converted / lora / skipped, by the stated rules."""
    plan = float8_plan(linears, layer_prefixes=PREFIXES, keep_fp32=KEEP)
    skipped = [name for name, _ in plan.skipped]
    assert sorted([*plan.converted, *plan.lora, *skipped]) == sorted(s.name for s in linears)
    assert set(plan.converted) == {s.name for s in linears if _qualifies(s) and not s.lora}
    assert set(plan.lora) == {s.name for s in linears if _qualifies(s) and s.lora}


@given(linears=linear_lists())
def test_head_and_embeddings_are_never_converted(linears):
    plan = float8_plan(linears, layer_prefixes=PREFIXES, keep_fp32=KEEP)
    assert not {"lm_head", "model.embed_tokens", "score"} & {*plan.converted, *plan.lora}


@given(linears=linear_lists(), data=st.data())
def test_plan_does_not_depend_on_the_order_of_the_linears(linears, data):
    shuffled = tuple(data.draw(st.permutations(linears)))
    a = float8_plan(linears, layer_prefixes=PREFIXES, keep_fp32=KEEP)
    b = float8_plan(shuffled, layer_prefixes=PREFIXES, keep_fp32=KEEP)
    assert sorted(a.converted) == sorted(b.converted) and sorted(a.lora) == sorted(b.lora)


def test_indivisible_dims_name_the_rule():
    spec = LinearSpec(name="model.layers.0.self_attn.k_proj", in_features=64, out_features=24)
    assert float8_plan((spec,), layer_prefixes=PREFIXES, keep_fp32=KEEP).skipped == (
        (spec.name, "[24, 64] is not divisible by 16 in both dims (a float8 GEMM needs it)"),
    )


FACTS = dict(
    device_type=st.sampled_from(["cuda", "cpu", "mps"]),
    capability=st.one_of(st.none(), st.tuples(st.integers(6, 10), st.integers(0, 9))),
    torchao_version=st.one_of(st.none(), st.sampled_from(["0.17.1", "0.18.0", "0.19.0+cu126"])),
    has_scaled_mm=st.booleans(),
    tp_size=st.integers(1, 4),
)


@given(**FACTS)
@example(
    device_type="cuda", capability=(9, 0), torchao_version="0.18.0", has_scaled_mm=True, tp_size=1
)
def test_supported_exactly_when_every_requirement_holds(
    device_type, capability, torchao_version, has_scaled_mm, tp_size
):
    reason = float8_unsupported_reason(
        device_type=device_type,
        capability=capability,
        torchao_version=torchao_version,
        has_scaled_mm=has_scaled_mm,
        tp_size=tp_size,
    )
    supported = (
        device_type == "cuda"
        and (capability is None or capability >= MIN_CAPABILITY)
        and has_scaled_mm
        and torchao_version is not None
        and version_tuple(torchao_version) >= (0, 18)
        and tp_size == 1
    )
    assert (reason is None) == supported


def test_old_gpu_reason_names_both_capabilities():
    reason = float8_unsupported_reason(
        device_type="cuda",
        capability=(8, 0),
        torchao_version="0.18.0",
        has_scaled_mm=True,
        tp_size=1,
    )
    assert reason is not None and ">= 8.9" in reason and "this GPU is 8.0" in reason


@given(
    parts=st.lists(st.integers(0, 999), min_size=1, max_size=4),
    suffix=st.sampled_from(["", "+cu126", ".dev20250101", "rc1"]),
)
def test_version_tuple_reads_the_release_numbers(parts, suffix):
    text = ".".join(map(str, parts)) + suffix
    assert version_tuple(text) == tuple(parts)

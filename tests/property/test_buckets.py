"""Properties of the refit bucket planners and the raw-byte pack/unpack round trip."""

import itertools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policyworker.functional.buckets import (
    IpcBucket,
    TensorSpec,
    align_up,
    default_ipc_buffer_bytes,
    pack_tensors,
    plan_broadcast_buckets,
    plan_ipc_buckets,
    split_ipc_budget,
    split_layout,
    split_views,
    unpack_tensors,
)
from tests.property.strategies import SEEDS

WIRE_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.int16,
]
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
specs_lists = st.lists(
    st.tuples(shapes, st.sampled_from(WIRE_DTYPES)), min_size=0, max_size=12
).map(lambda items: [TensorSpec(f"t{i}", s, d) for i, (s, d) in enumerate(items)])
byte_sizes = st.lists(st.integers(0, 5000), min_size=0, max_size=20)


def _specs_of_sizes(sizes):
    return [TensorSpec(f"p{i}", (n,), torch.uint8) for i, n in enumerate(sizes)]


def _random_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if spec.dtype == torch.bool:
        return torch.randint(0, 2, spec.shape, generator=g).bool()
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, generator=g, dtype=torch.float64).to(spec.dtype)
    info = torch.iinfo(spec.dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), spec.shape, generator=g
    ).to(spec.dtype)


@given(n=st.integers(0, 10**7), alignment=st.sampled_from([1, 2, 64, 512, 4096]))
def test_align_up_is_the_smallest_aligned_upper_bound(n, alignment):
    a = align_up(n, alignment)
    assert a % alignment == 0 and n <= a < n + alignment


@given(sizes=byte_sizes, buffer_multiple=st.integers(1, 12))
@example(sizes=[512, 3072, 512], buffer_multiple=4)
@example(sizes=[2048], buffer_multiple=4)
@example(sizes=[2049], buffer_multiple=4)
def test_ipc_plan_covers_every_tensor_once_in_order_within_the_buffer(sizes, buffer_multiple):
    buffer_bytes = 512 * buffer_multiple
    specs = _specs_of_sizes(sizes)
    plan = plan_ipc_buckets(specs, buffer_bytes)
    assert [i for b in plan for i in b.indices] == list(range(len(specs)))
    for bucket in plan:
        assert bucket.names == tuple(specs[i].name for i in bucket.indices)
        ends = [
            o + align_up(specs[i].nbytes)
            for i, o in zip(bucket.indices, bucket.offsets, strict=True)
        ]
        assert all(o % 512 == 0 for o in bucket.offsets)
        assert list(bucket.offsets[1:]) == ends[:-1]  # packed back to back, aligned
        assert bucket.used_bytes == ends[-1]
        if bucket.oversized:
            assert len(bucket.indices) == 1 and bucket.used_bytes > buffer_bytes
        else:
            assert bucket.used_bytes <= buffer_bytes
    # greedy: a bucket is flushed only when the next tensor did not fit
    for left, right in itertools.pairwise(plan):
        if not left.oversized and not right.oversized:
            assert left.used_bytes + align_up(specs[right.indices[0]].nbytes) > buffer_bytes


def test_ipc_plan_reference_cases_of_a_4096_byte_budget():
    per_buffer = split_ipc_budget(4096)
    assert per_buffer == 2048
    plan = plan_ipc_buckets(_specs_of_sizes([512, 3072, 512]), per_buffer)
    assert plan == [
        IpcBucket((0,), ("p0",), (0,), 512, False),
        IpcBucket((1,), ("p1",), (0,), 3072, True),
        IpcBucket((2,), ("p2",), (0,), 512, False),
    ]
    assert plan_ipc_buckets(_specs_of_sizes([2048]), per_buffer) == [
        IpcBucket((0,), ("p0",), (0,), 2048, False)
    ]
    assert plan_ipc_buckets(_specs_of_sizes([2049]), per_buffer) == [
        IpcBucket((0,), ("p0",), (0,), 2560, True)
    ]
    two_big = plan_ipc_buckets(_specs_of_sizes([3000, 3000]), per_buffer)
    assert [b.oversized for b in two_big] == [True, True]
    eight = plan_ipc_buckets(_specs_of_sizes([512] * 8), per_buffer)
    assert 1 < len(eight) < 8 and [n for b in eight for n in b.names] == [f"p{i}" for i in range(8)]
    mixed = plan_ipc_buckets(
        [TensorSpec("weight", (4,), torch.float32), TensorSpec("bias", (3,), torch.float16)], 2048
    )
    assert mixed == [IpcBucket((0, 1), ("weight", "bias"), (0, 512), 1024, False)]


def test_ipc_plan_rejects_unaligned_buffer():
    with pytest.raises(ValueError, match="multiple of the alignment 512"):
        plan_ipc_buckets(_specs_of_sizes([1]), 1000)
    with pytest.raises(ValueError, match="must be > 0"):
        split_ipc_budget(0)


@given(sizes=byte_sizes, target=st.integers(1, 9000))
def test_broadcast_plan_closes_right_after_the_tensor_that_crosses_the_target(sizes, target):
    specs = _specs_of_sizes(sizes)
    plan = plan_broadcast_buckets(specs, target)
    assert [i for b in plan for i in b] == list(range(len(specs)))
    for k, bucket in enumerate(plan):
        total = sum(specs[i].nbytes for i in bucket)
        prefix = sum(specs[i].nbytes for i in bucket[:-1])
        assert prefix <= target  # never closed late
        if k < len(plan) - 1:
            assert total > target  # never closed early
    assert sum(s.nbytes for s in specs) == sum(
        specs[i].nbytes for b in plan for i in b
    )  # no padding


def test_broadcast_plan_reference_cases():
    assert plan_broadcast_buckets([TensorSpec("w", (1000, 1000), torch.float32)], 100) == [[0]]
    many = [TensorSpec(f"w{i}", (10, 10), torch.float32) for i in range(20)]
    assert len(plan_broadcast_buckets(many, 2000)) > 1


@given(specs=specs_lists, seed=SEEDS, transpose=st.booleans())
@settings(max_examples=60)
def test_pack_then_unpack_round_trips_raw_bytes_of_any_dtype_and_layout(specs, seed, transpose):
    tensors = [_random_tensor(s, seed + i) for i, s in enumerate(specs)]
    if transpose:  # non-contiguous sources
        tensors = [t.t().contiguous().t() if t.dim() == 2 else t for t in tensors]
        tensors = [
            t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() >= 2 else t for t in tensors
        ]
    offsets, pos = [], 0
    for t in tensors:  # unaligned on purpose: misaligned slices must still come back exact
        offsets.append(pos)
        pos += t.numel() * t.element_size() + 1
    buffer = torch.zeros(pos + 1, dtype=torch.uint8)
    pack_tensors(tensors, offsets, buffer)
    out = unpack_tensors(buffer, specs, offsets)
    for t, o, s in zip(tensors, out, specs, strict=True):
        assert o.dtype == s.dtype and tuple(o.shape) == s.shape
        assert torch.equal(o.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_pack_handles_zero_dim_and_strided_views():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = [
        torch.tensor(3.5, dtype=torch.bfloat16),
        base.t(),
        base[:, ::2],
        base.permute(1, 0)[1:4],
    ]
    specs = [TensorSpec.of(f"x{i}", t) for i, t in enumerate(tensors)]
    plan = plan_ipc_buckets(specs, 2048)
    assert len(plan) == 1
    buffer = torch.empty(plan[0].used_bytes, dtype=torch.uint8)
    pack_tensors(tensors, plan[0].offsets, buffer)
    for t, o in zip(tensors, unpack_tensors(buffer, specs, plan[0].offsets), strict=True):
        assert torch.equal(t, o)


def test_pack_rejects_ranges_outside_the_buffer():
    with pytest.raises(ValueError, match="does not fit"):
        pack_tensors([torch.zeros(4)], [500], torch.empty(512, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1-D uint8"):
        pack_tensors([torch.zeros(4)], [0], torch.empty(16))


@given(
    sizes=byte_sizes, cap=st.integers(1, 10**6), free=st.one_of(st.none(), st.integers(0, 10**8))
)
def test_default_buffer_is_aligned_positive_and_fits_the_largest_tensor_when_memory_allows(
    sizes, cap, free
):
    specs = _specs_of_sizes(sizes)
    per_buffer = default_ipc_buffer_bytes(specs, cap_bytes=cap, free_bytes=free)
    assert per_buffer > 0 and per_buffer % 512 == 0
    largest = max((align_up(n) for n in sizes), default=0)
    if free is None or 4 * largest <= free:
        assert per_buffer >= largest  # never "every big tensor oversized"
    assert per_buffer <= max(512, sum(align_up(n) for n in sizes), largest)


@given(
    items=st.lists(shapes, max_size=12),
    dtype=st.sampled_from(WIRE_DTYPES),
    seed=SEEDS,
    alignment=st.sampled_from([8, 512]),
)
@settings(max_examples=60)
def test_split_views_equal_unpack_tensors_and_alias_the_buffer(items, dtype, seed, alignment):
    specs = [TensorSpec(f"t{i}", shape, dtype) for i, shape in enumerate(items)]
    plan = plan_ipc_buckets(specs, 1 << 20, alignment=alignment)
    buffer = torch.randint(
        0, 256, (max(1 << 20, 1),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    for bucket in plan:
        bucket_specs = [specs[i] for i in bucket.indices]
        layout = split_layout(bucket_specs, bucket.offsets)
        assert layout is not None and layout.end_bytes <= bucket.used_bytes
        want = unpack_tensors(buffer, bucket_specs, bucket.offsets)
        got = split_views(buffer, layout)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
            assert g.numel() == 0 or g.data_ptr() == w.data_ptr()  # views, no copies


def test_split_layout_declines_what_it_cannot_cut_in_one_split():
    f32 = [TensorSpec("a", (3,), torch.float32), TensorSpec("b", (2,), torch.float32)]
    layout = split_layout(f32, [0, 512])
    assert layout is not None and layout.split_sizes == (3, 125, 2) and layout.picks == (0, 2)
    assert (
        split_layout([f32[0], TensorSpec("c", (2,), torch.int64)], [0, 512]) is None
    )  # mixed dtypes
    assert split_layout(f32, [0, 2]) is None  # misaligned for float32
    assert split_layout(f32, [0, 8]) is None  # overlapping
    assert split_layout(f32, [512, 0]) is None  # descending
    with pytest.raises(ValueError, match="cannot hold"):
        split_views(torch.zeros(100, dtype=torch.uint8), layout)

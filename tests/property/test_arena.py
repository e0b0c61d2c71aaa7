"""Properties of the one-pass arena layout: plans, destination checks, the view round trip."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.arena import (
    Destination,
    destination_of,
    destination_problems,
    destination_span,
    destination_view,
    ordered_destinations,
    plan_arena,
)
from policyworker.functional.buckets import TensorSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
spec_lists = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), max_size=10).map(
    lambda items: [TensorSpec(f"t{i}", s, d) for i, (s, d) in enumerate(items)]
)


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _registered(specs, alignment=512):
    """Each spec as a whole tensor of its own in a planned arena (what a receiver registers)."""
    plan = plan_arena([s.nbytes for s in specs], alignment=alignment)
    dests = [
        Destination(s.name, s.dtype, s.shape, _contiguous_strides(s.shape), offset)
        for s, offset in zip(specs, plan.offsets, strict=True)
    ]
    return plan, dests


@given(
    sizes=st.lists(st.integers(0, 5000), max_size=20),
    alignment=st.sampled_from([1, 2, 64, 512]),
)
def test_arena_plan_is_aligned_in_order_without_overlaps_and_holds_everything(sizes, alignment):
    plan = plan_arena(sizes, alignment=alignment)
    assert len(plan.offsets) == len(sizes)
    assert all(offset % alignment == 0 for offset in plan.offsets)
    ends = [offset + size for offset, size in zip(plan.offsets, sizes, strict=True)]
    assert all(end <= nxt for end, nxt in zip(ends, plan.offsets[1:], strict=False))
    assert plan.total_bytes >= max(ends, default=0) and plan.total_bytes % alignment == 0
    assert plan.total_bytes < sum(sizes) + (len(sizes) + 1) * alignment


@given(specs=spec_lists)
def test_a_registered_arena_passes_the_check_and_orders_by_manifest(specs):
    plan, dests = _registered(specs)
    assert destination_problems(specs, dests[::-1], arena_bytes=plan.total_bytes) == []
    assert [d.name for d in ordered_destinations(specs, dests[::-1])] == [s.name for s in specs]


@given(specs=spec_lists.filter(lambda s: len(s) > 0), data=st.data())
def test_every_kind_of_bad_registration_is_named_before_any_write(specs, data):
    plan, dests = _registered(specs)
    k = data.draw(st.integers(0, len(specs) - 1))
    victim = dests[k]
    dropped = dests[:k] + dests[k + 1 :]
    assert any(
        "no registered destination" in p
        for p in destination_problems(specs, dropped, arena_bytes=plan.total_bytes)
    )
    extra = [*dests, Destination("ghost", torch.int8, (1,), (1,), 0)]
    assert any(
        "not in the manifest" in p
        for p in destination_problems(specs, extra, arena_bytes=plan.total_bytes)
    )
    other = torch.int32 if victim.dtype != torch.int32 else torch.int64
    retyped = [*dropped, Destination(victim.name, other, victim.shape, victim.strides, 0)]
    assert any(
        "mismatch" in p for p in destination_problems(specs, retyped, arena_bytes=plan.total_bytes)
    )
    if victim.numel:
        shifted = [
            *dropped,
            Destination(victim.name, victim.dtype, victim.shape, victim.strides, plan.total_bytes),
        ]
        assert any(
            "run past the arena" in p
            for p in destination_problems(specs, shifted, arena_bytes=plan.total_bytes)
        )


def test_dense_overlaps_are_refused_and_interleaved_strided_pieces_are_not():
    manifest = [TensorSpec("a", (4,), torch.float32), TensorSpec("b", (4,), torch.float32)]
    overlapping = [
        Destination("a", torch.float32, (4,), (1,), 0),
        Destination("b", torch.float32, (4,), (1,), 8),
    ]
    assert any(
        "overlapping" in p for p in destination_problems(manifest, overlapping, arena_bytes=64)
    )
    # gate and up halves of a transposed fused tensor: every other element each
    interleaved = [
        Destination("a", torch.float32, (4,), (2,), 0),
        Destination("b", torch.float32, (4,), (2,), 4),
    ]
    assert destination_problems(manifest, interleaved, arena_bytes=32) == []
    assert destination_problems(manifest, interleaved, arena_bytes=31) != []


@given(specs=spec_lists, seed=st.integers(0, 2**16))
def test_destination_view_then_destination_of_is_identity_and_views_are_disjoint(specs, seed):
    plan, dests = _registered(specs, alignment=64)
    arena = torch.zeros(max(plan.total_bytes, 1), dtype=torch.uint8)
    for dest in dests:
        view = destination_view(arena, dest)
        assert view.dtype == dest.dtype and tuple(view.shape) == dest.shape
        assert destination_of(view, arena, name=dest.name) == dest
        lo, hi = destination_span(dest)
        assert view.numel() * view.element_size() == hi - lo
    # writing every view leaves each one holding what was written (no two share a byte)
    g = torch.Generator().manual_seed(seed)
    written = {}
    for dest in dests:
        value = torch.randint(0, 100, dest.shape, generator=g).to(dest.dtype)
        destination_view(arena, dest).copy_(value)
        written[dest.name] = value
    for dest in dests:
        assert torch.equal(destination_view(arena, dest), written[dest.name])


def test_a_strided_piece_round_trips_and_a_foreign_tensor_is_refused():
    arena = torch.zeros(4096, dtype=torch.uint8)
    fused = destination_view(arena, Destination("fused", torch.float32, (2, 6, 4), (24, 4, 1), 512))
    piece = fused[1][:, :2].t()  # one expert, its first half of each row, transposed: strided
    dest = destination_of(piece, arena, name="piece")
    assert not dest.is_dense and math.prod(dest.shape) == piece.numel()
    assert destination_view(arena, dest).data_ptr() == piece.data_ptr()
    assert destination_view(arena, dest).stride() == piece.stride()
    with pytest.raises(ValueError, match="not a view inside the arena"):
        destination_of(torch.zeros(3), arena, name="foreign")


def test_bad_plan_arguments_name_the_rule():
    with pytest.raises(ValueError, match="power of two"):
        plan_arena([1], alignment=3)
    with pytest.raises(ValueError, match=r"nbytes\[1\] is -1"):
        plan_arena([1, -1])

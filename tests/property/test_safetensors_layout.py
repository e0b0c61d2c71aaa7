"""Properties of policyworker.functional.safetensors_layout (pure checkpoint layout math)."""

import itertools
import json
import math
import struct

import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.safetensors_layout import (
    MAX_FILE_BYTES,
    MIN_SPREAD_FILE_BYTES,
    WRITE_STREAMS,
    HFTensor,
    contiguous_runs,
    file_bytes_for_parallel_writes,
    intersect_boxes,
    plan_safetensors_files,
)

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8])
SHAPES = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@given(st.lists(st.tuples(SHAPES, DTYPES), min_size=1, max_size=8), st.integers(1, 400))
def test_files_hold_every_tensor_once_back_to_back_within_the_size_limit(specs, max_bytes):
    tensors = [
        HFTensor(f"t{i}", f"t{i}", tuple((0, n) for n in shape), shape, dtype)
        for i, (shape, dtype) in enumerate(specs)
    ]
    plans = plan_safetensors_files(tensors, max_file_bytes=max_bytes)
    assert [p.file for p in plans] == [
        f"model-{i:05d}-of-{len(plans):05d}.safetensors" for i in range(1, len(plans) + 1)
    ]
    seen = []
    for plan in plans:
        n = struct.unpack("<Q", plan.header[:8])[0]
        assert len(plan.header) == 8 + n and n % 8 == 0
        header = json.loads(plan.header[8:])
        names = [k for k in header if k != "__metadata__"]
        seen += names
        end = 0
        for name in names:  # in order, back to back: what a safetensors reader expects
            begin, stop = header[name]["data_offsets"]
            assert begin == end and plan.offsets[name] == len(plan.header) + begin
            end = stop
        assert plan.size == len(plan.header) + end
        assert end <= max_bytes or len(names) == 1  # only a lone oversized tensor exceeds it
    assert seen == [t.name for t in tensors]


@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=3
    )
)
def test_contiguous_runs_cover_a_sub_box_exactly_once(dims):
    full = tuple((0, n) for n, _, _ in dims)
    sub = tuple((min(a, n - 1), min(min(a, n - 1) + k, n)) for n, a, k in dims)
    covered = []
    for offset, _, length in contiguous_runs(sub, full):
        covered += range(offset, offset + length)
    shape = [n for n, _, _ in dims]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    want = sorted(
        sum(i * s for i, s in zip(idx, strides, strict=True))
        for idx in itertools.product(*(range(lo, hi) for lo, hi in sub))
    )
    assert sorted(covered) == want and len(covered) == len(set(covered))
    assert intersect_boxes(sub, full) == sub


@given(st.integers(0, 1 << 40), st.integers(0, 1 << 40))
def test_the_shard_size_spreads_weights_over_the_write_streams_within_its_bounds(total, more):
    size = file_bytes_for_parallel_writes(total)
    assert MIN_SPREAD_FILE_BYTES <= size <= MAX_FILE_BYTES
    if size == MIN_SPREAD_FILE_BYTES:  # small: at most WRITE_STREAMS files of the floor size
        assert total <= WRITE_STREAMS * MIN_SPREAD_FILE_BYTES
    elif size < MAX_FILE_BYTES:  # WRITE_STREAMS files hold it, and fewer would not
        assert WRITE_STREAMS * size >= total > (WRITE_STREAMS - 1) * size
    else:  # huge: HF's cap, so more than WRITE_STREAMS files
        assert total >= WRITE_STREAMS * MAX_FILE_BYTES
    assert file_bytes_for_parallel_writes(total + more) >= size  # never smaller for more bytes

"""A bounce buffer's host copy: equal to its source, in storage of exactly its bytes, for any
dtype, shape, layout and chunk size; a pool gives each thread its own buffer and frees them all."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.shell.checkpoint import bounce

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 7), min_size=0, max_size=3),
    transposed=st.booleans(),
    chunk=st.integers(1, 97),
    seed=st.integers(0, 2**16),
)
def test_to_host_round_trips_any_tensor_in_storage_of_exactly_its_bytes(
    dtype, shape, transposed, chunk, seed
):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(0, 256, shape, generator=generator, dtype=torch.int64).to(dtype)
    if transposed and source.dim() >= 2:
        source = source.transpose(0, 1)  # not contiguous: copied out after a contiguous copy
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bounce, "BOUNCE_BYTES", chunk)
        own = bounce.Bounce()
        try:
            host = own.to_host(source)
        finally:
            own.release()
    assert host.dtype == source.dtype and host.shape == source.shape
    assert torch.equal(host, source)
    assert host.untyped_storage().nbytes() == host.nbytes  # DCP's writer would clone it otherwise
    if source.numel():
        assert host.data_ptr() != source.data_ptr()


def test_a_pool_gives_each_thread_one_buffer_and_releases_them_all():
    pool = bounce.BouncePool()
    seen: dict[str, list[bounce.Bounce]] = {}
    start = threading.Barrier(3, timeout=10)

    def ask(name: str) -> None:
        start.wait()
        seen[name] = [pool.for_this_thread(), pool.for_this_thread()]
        seen[name][0].to_host(torch.arange(10))  # allocates the thread's buffer

    threads = [threading.Thread(target=ask, args=(str(i),)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert all(first is second for first, second in seen.values())  # one buffer per thread
    assert len({id(first) for first, _ in seen.values()}) == 3
    assert all(first._buffer is not None for first, _ in seen.values())
    pool.release()
    assert all(first._buffer is None for first, _ in seen.values())
    assert pool.for_this_thread() is not seen["0"][0]  # a released pool starts afresh

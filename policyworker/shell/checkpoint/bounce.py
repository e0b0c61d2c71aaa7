"""Page-locked bounce buffers: how a sync save copies device state out while it writes.

Each writer thread of a sync save owns one `Bounce`: a `BOUNCE_BYTES` page-locked host buffer
and one CUDA stream per device. A device run is copied into the buffer chunk by chunk (a
non-blocking copy on the thread's own stream, then a wait on that stream alone), so the threads'
copies run side by side and overlap each other's disk writes. `tensor.cpu()` called from several
threads instead issues synchronous copies into pageable memory on the legacy default stream,
which wait for each other and for every other stream's work. On an H200 (1.5B + AdamW, 8 writer
threads, one run) a sync save of the optimizer alone, 12.4 GB, took 15.4 s that way (0.80 GB/s)
and 7.8 s through bounce buffers (1.59 GB/s, as fast as the weights through theirs).

Used by both writers of a sync save: the safetensors weights (`safetensors_io`: chunks are
`pwrite`n straight from the buffer) and the optimizer through DCP (`dcp`: its save planner hands
DCP's writer threads a CPU copy of each device tensor, made through the asking thread's buffer).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from policyworker.shell.checkpoint.saver import _register

__all__ = ["BOUNCE_BYTES", "Bounce", "BouncePool", "bounced"]

# A sync save's device-to-host copy unit: the size of each writer thread's page-locked bounce
# buffer. Large enough that the per-chunk stream synchronize is a small part of the chunk's
# write, small enough that one buffer per writer thread pins little host memory (8 x 64 MiB).
BOUNCE_BYTES = 64 * 2**20


def bounced(tensor: torch.Tensor) -> bool:
    """Whether data is copied out through a bounce buffer (not on the CPU: `pwrite` and DCP's
    writer cannot read device memory). A function so the CPU tests can route CPU data through
    it."""
    return tensor.device.type != "cpu"


class Bounce:
    """One writer thread's page-locked host buffer and copy streams, for one sync save."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._unpin: Any = None
        self._streams: dict[torch.device, Any] = {}

    def copy_out(self, src: torch.Tensor, ready: Any) -> torch.Tensor:
        """`src` (uint8, at most BOUNCE_BYTES) copied into the buffer; landed when it returns.

        `ready`: a CUDA event the copy waits for (the point after which `src` holds its final
        values), or None when the caller already waited.
        """
        if self._buffer is None:
            self._buffer = torch.empty(BOUNCE_BYTES, dtype=torch.uint8)
            self._unpin = _register(self._buffer)  # None without CUDA: stays pageable
        dst = self._buffer[: src.numel()]
        if src.device.type != "cuda":
            return dst.copy_(src)
        stream = self._streams.get(src.device)
        if stream is None:
            stream = self._streams[src.device] = torch.cuda.Stream(src.device)
        if ready is not None:
            stream.wait_event(ready)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()  # one chunk of work: bounded by the chunk's copy
        return dst

    def to_host(self, tensor: torch.Tensor, ready: Any = None) -> torch.Tensor:
        """A new CPU tensor equal to `tensor`, copied in `BOUNCE_BYTES` chunks through the
        buffer. Its storage holds exactly its bytes (DCP's writer clones any other tensor)."""
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()  # on the caller's stream: the copies wait for it
            if tensor.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(tensor.device))
        raw = tensor.reshape(-1).view(torch.uint8)
        host = torch.empty(raw.numel(), dtype=torch.uint8)
        for start in range(0, raw.numel(), BOUNCE_BYTES):
            chunk = raw[start : start + BOUNCE_BYTES]
            host[start : start + chunk.numel()].copy_(self.copy_out(chunk, ready))
        return host.view(tensor.dtype).view(tensor.shape)

    def release(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()  # a copy in flight when a write failed still targets the buffer
        if self._unpin is not None:
            self._unpin()  # before the memory goes back to the allocator
        self._buffer, self._unpin = None, None


class BouncePool:
    """One `Bounce` per thread that asks for one, for one save: for writer threads that a
    library starts (DCP's), which cannot release their own buffer when they end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[int, Bounce] = {}

    def for_this_thread(self) -> Bounce:
        ident = threading.get_ident()
        with self._lock:
            bounce = self._by_thread.get(ident)
            if bounce is None:
                bounce = self._by_thread[ident] = Bounce()
            return bounce

    def release(self) -> None:
        """Free every thread's buffer; call once the save's threads have ended."""
        with self._lock:
            bounces, self._by_thread = list(self._by_thread.values()), {}
        for bounce in bounces:
            bounce.release()

"""DCP's file system, hashing every file it writes as the bytes pass through.

DCP's writer threads each write whole files front to back (`torch.save` of each item, then the
next), so the file's tree digest (`digests.TreeHasher`) is computed from the bytes in hand and
noted for the commit (`digests.record_written`) instead of read back afterwards. A stream that
is seeked or truncated is not noted (the commit then reads that file back).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from policyworker.shell.checkpoint.digests import TreeHasher, record_written

__all__ = ["HashingFileSystem"]


class _HashingStream:
    """A binary write stream that hashes every byte written through it, in order."""

    def __init__(self, raw: Any, hasher: TreeHasher) -> None:
        self._raw, self.hasher = raw, hasher
        self.intact = True  # every byte of the file went through write(), front to back

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        self.hasher.update(view if written is None else view[:written])
        if written is not None and written != len(view):
            self.intact = False  # a short write of a raw stream: the caller rewrites the rest
        return len(view) if written is None else written

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def seek(self, *args: Any) -> int:
        self.intact = False
        return self._raw.seek(*args)

    def truncate(self, *args: Any) -> int:
        self.intact = False
        return self._raw.truncate(*args)

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # tell, fileno, flush, close, closed, ...
        return getattr(self._raw, name)


class HashingFileSystem(FileSystem):
    """`FileSystem` whose "wb" streams hash what they write and note the digest on close."""

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self.algorithm = algorithm

    @contextlib.contextmanager
    def create_stream(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[Any, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw, TreeHasher(self.algorithm))
            yield stream
        if stream.intact:  # closed: its size and modification time are final
            hasher = stream.hasher
            record_written(path, hasher.hexdigest(), hasher=hasher, size=hasher.size)

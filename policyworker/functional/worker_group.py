"""The arithmetic of a group of worker processes: node-local ranks, data-parallel
representatives and version ranges (used by `policyworker.shell.ray`).

Ranks are laid out row-major over (dp, cp, tp), tp fastest, as in `shell.parallel.context`.

All functions are pure: they never modify their arguments and read no runtime state.
"""

from collections.abc import Sequence

__all__ = ["dp_leader_ranks", "local_ranks", "version_in_range", "version_tuple"]


def local_ranks(node_of_rank: Sequence[str]) -> list[int]:
    """The rank of each process among the processes on its node, counted in global rank order.

    Example: nodes ``["a", "b", "a", "a"]`` -> ``[0, 0, 1, 2]``.
    """
    seen: dict[str, int] = {}
    out: list[int] = []
    for node in node_of_rank:
        out.append(seen.get(node, 0))
        seen[node] = out[-1] + 1
    return out


def dp_leader_ranks(*, world_size: int, cp_size: int, tp_size: int) -> list[int]:
    """For each data-parallel rank (in order), the global rank with cp_rank = tp_rank = 0.

    The ranks of one (cp, tp) block hold the same data shard and return the same rows, so one
    of them speaks for the block. Example: world 4, tp 2 -> ``[0, 2]``.

    Raises:
        ValueError: sizes below 1, or world_size not a multiple of cp_size * tp_size.
    """
    block = cp_size * tp_size
    if min(world_size, cp_size, tp_size) < 1 or world_size % block:
        msg = (
            f"world_size={world_size} must be a positive multiple of cp_size * tp_size = "
            f"{cp_size} * {tp_size}; choose sizes whose product divides the number of workers"
        )
        raise ValueError(msg)
    return list(range(0, world_size, block))


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"2.60.0rc1"`` -> ``(2, 60, 0)``.

    Raises:
        ValueError: the string does not start with a number.
    """
    parts: list[int] = []
    for piece in text.strip().split("."):
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) < len(piece):  # "0rc1": the release part ends here
            break
    if not parts:
        msg = f"version {text!r} does not start with a number; expected a form like '2.60.0'"
        raise ValueError(msg)
    return tuple(parts)


def version_in_range(version: str, *, minimum: tuple[int, ...], below: tuple[int, ...]) -> bool:
    """``minimum <= release(version) < below``, comparing release numbers (pre-releases count
    as their release)."""
    release = version_tuple(version)
    return minimum <= release < below

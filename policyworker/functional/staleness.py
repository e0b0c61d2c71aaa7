"""Per-token weight versions: how stale each trained token is, its statistics, and the mask that
drops tokens older than a bound.

A rollout sampled while the weights change carries ``generation_versions`` [B, S] (int) beside
``generation_logprobs``: the weight version that sampled each token. A token's *version lag*
is ``policy_version - generation_versions`` (0: sampled by the weights being trained). The
worker's policy version counts the optimizer steps it applied (see
`PolicyWorker.policy_version`); a batch may pin it with ``policy_version`` [B].

Shape legend: ``B`` rows, ``S`` padded length, ``T = S - 1``. All functions are pure.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from policyworker.errors import DataError

__all__ = [
    "VERSION_KEYS",
    "check_generation_versions",
    "fresh_token_mask",
    "token_versions",
    "version_lag",
    "version_lag_stats",
]

# The batch keys of per-token versions: [B, S] token versions and [B] policy version per row.
VERSION_KEYS = ("generation_versions", "policy_version")


def version_lag(versions_BS: Tensor, policy_version_B: Tensor) -> Tensor:
    """[B, S] int64: ``policy_version - version`` of every token (padding included)."""
    return policy_version_B.to(torch.int64)[:, None] - versions_BS.to(torch.int64)


def version_lag_stats(lag_BS: Tensor, counted_BS: Tensor) -> dict[str, float]:
    """``max_version_lag`` and ``mean_version_lag`` over the counted positions (0.0 and 0.0 when
    none is counted) and ``version_lag_tokens`` (how many were counted, for weighting means)."""
    lags = lag_BS[counted_BS.to(torch.bool)]
    if lags.numel() == 0:
        return {"max_version_lag": 0.0, "mean_version_lag": 0.0, "version_lag_tokens": 0.0}
    return {
        "max_version_lag": float(lags.max()),
        "mean_version_lag": float(lags.to(torch.float64).mean()),
        "version_lag_tokens": float(lags.numel()),
    }


def fresh_token_mask(lag_BT: Tensor, max_lag: int, like_BT: Tensor) -> Tensor:
    """[B, T] in ``like_BT``'s dtype: 1 where a token's lag is at most ``max_lag``, else 0."""
    return (lag_BT <= max_lag).to(like_BT.dtype)


def check_generation_versions(data: Mapping[str, Any]) -> None:
    """Refuse bad version keys (a `DataError` naming key, value and fix): integer
    ``generation_versions`` shaped like ``input_ids``, an integer ``policy_version`` [B], and
    no counted token newer than its row's policy version. A batch without versions passes."""
    versions = data.get("generation_versions")
    policy = data.get("policy_version")
    if versions is None:
        if policy is not None:
            raise DataError(
                "data['policy_version'] is given without data['generation_versions']; pass the "
                "per-token versions [B, S] too, or drop policy_version"
            )
        return
    ids = data["input_ids"]
    _require_int(versions, "generation_versions", f"[B, S] = {tuple(ids.shape)}")
    if tuple(versions.shape) != tuple(ids.shape):
        raise DataError(
            f"data['generation_versions'] has shape {tuple(versions.shape)}; it holds one "
            f"version per token: pass a [B, S] tensor shaped like input_ids {tuple(ids.shape)}"
        )
    if policy is None:
        return
    _require_int(policy, "policy_version", f"[B] = ({ids.shape[0]},)")
    if tuple(policy.shape) != (ids.shape[0],):
        raise DataError(
            f"data['policy_version'] has shape {tuple(policy.shape)}; pass one version per row, "
            f"shape ({ids.shape[0]},)"
        )
    lag = version_lag(versions, policy)
    counted = _within_lengths(data)
    if bool((lag[counted] < 0).any()):
        worst = int(versions[counted].max())
        raise DataError(
            f"data['generation_versions'] holds version {worst}, newer than "
            f"policy_version {int(policy.min())}: a token cannot come from weights the policy "
            f"has not reached; pass data['policy_version'] [B] with the version being trained"
        )


def _require_int(value: Any, key: str, shape: str) -> None:
    if not isinstance(value, Tensor) or value.dtype.is_floating_point or value.dtype.is_complex:
        kind = value.dtype if isinstance(value, Tensor) else type(value).__name__
        raise DataError(
            f"data[{key!r}] must be an integer tensor {shape}, got {kind}; weight versions are "
            f"counts: cast with .long()"
        )
    if value.dtype == torch.bool:
        raise DataError(f"data[{key!r}] must be an integer tensor {shape}, got bool; use .long()")


def _within_lengths(data: Mapping[str, Any]) -> Tensor:
    ids = data["input_ids"]
    columns = torch.arange(ids.shape[1], device=ids.device)[None]
    return (columns >= 1) & (columns < data["input_lengths"].to(ids.device)[:, None])


def token_versions(num_tokens: int, swaps: Sequence[tuple[int, int]], initial: int) -> list[int]:
    """The weight version of each of a request's ``num_tokens`` output tokens: ``initial`` until
    the first swap; ``swaps`` holds ``(output tokens sampled before the swap, version after it)``
    in swap order (an engine reports the count per running request at each swap)."""
    versions = [initial] * num_tokens
    for before, version in swaps:
        versions[max(before, 0) :] = [version] * max(num_tokens - max(before, 0), 0)
    return versions

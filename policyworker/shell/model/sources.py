"""Where a model's config and weights come from, checked before transformers reads them.

Each check turns what would be a raw transformers error, a silent wrong model, or a long wait
into one message naming the folder or id and the fix: a local folder without config.json or
weights; a Hub id while the Hub cannot be reached (fails in seconds instead of retrying, and
names `HF_HUB_OFFLINE`); a weights folder whose config describes another model than
`model_name`; a reward model built from a folder without a trained score head.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import urllib.parse
from collections.abc import Sequence
from typing import Any

__all__ = [
    "SHAPE_KEYS",
    "check_local_folder",
    "check_same_model",
    "hub_local_files_only",
    "warn_if_untrained_head",
]

log = logging.getLogger("policyworker")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".distcp")
# What fixes a model's architecture and parameter shapes: two configs that differ in any of
# these describe different models (the keys a config lacks are not compared).
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
)
_HUB_PROBE_TIMEOUT_S = 3.0
_WARNED_HEADS: set[str] = set()


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or source.count("/") > 1


def check_local_folder(source: str, key: str, *, weights: bool = True) -> None:
    """ValueError when `source` is a local folder (or a path) that cannot hold a model."""
    if not os.path.isdir(source):
        if _looks_like_path(source):
            msg = (
                f"{key}={source!r}: no such folder; pass the folder save_pretrained wrote "
                f"(config.json and the weights), or a Hugging Face Hub model id"
            )
            raise ValueError(msg)
        return
    names = sorted(os.listdir(source))
    shown = f"it holds {names[:8]}{' ...' if len(names) > 8 else ''}" if names else "it is empty"
    if "config.json" not in names:
        msg = (
            f"{key}={source!r}: that folder has no config.json ({shown}); pass the folder "
            f"save_pretrained wrote (config.json and the weights), or a Hub model id"
        )
        raise ValueError(msg)
    if weights and not any(n in _WEIGHT_FILES or n.endswith(_WEIGHT_SUFFIXES) for n in names):
        msg = (
            f"{key}={source!r}: that folder has config.json but no weights (*.safetensors or "
            f"pytorch_model.bin; {shown}); copy the weights next to it, or pass the folder "
            f"save_pretrained wrote"
        )
        raise ValueError(msg)


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


@functools.cache
def _reachable(endpoint: str) -> str | None:
    """None when a TCP connection to `endpoint` opens within the probe timeout, else why not."""
    url = urllib.parse.urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=_HUB_PROBE_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def _cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id the cache cannot even parse: the download names it
        return False
    return isinstance(found, str)


def hub_local_files_only(source: str, key: str) -> bool:
    """For a Hub id: True to read it from the local cache only (offline, or the Hub unreachable
    and the model cached); ValueError at once when the Hub is unreachable and it is not cached.

    transformers would otherwise retry the download for about half a minute, then say neither
    what to set nor that the model is simply not cached.
    """
    from huggingface_hub import constants

    if os.path.isdir(source):
        return False
    if constants.HF_HUB_OFFLINE:
        return True
    endpoint = _hub_endpoint()
    why = _reachable(endpoint)
    if why is None:
        return False
    if _cached(source):
        log.info("Hub unreachable (%s); %s=%r loads from the local cache", why, key, source)
        return True
    msg = (
        f"{key}={source!r} is not a local folder, and the Hugging Face Hub ({endpoint}) cannot "
        f"be reached ({why}) while the model is not in the local cache. Without a network: "
        f"download it where there is one (huggingface-cli download {source}), copy the cache "
        f"(HF_HOME) here and set HF_HUB_OFFLINE=1, or pass a local folder"
    )
    raise ValueError(msg)


def check_same_model(model_config: Any, weights_config: Any, *, model: str, weights: str) -> None:
    """ValueError when the weights folder's config describes another model than `model_name`'s.

    The model is built from the weights folder's config, so a mismatch would silently train a
    different architecture than the config (and the start-up line) names.
    """
    differ = [
        f"{k}: {getattr(model_config, k)!r} vs {getattr(weights_config, k)!r}"
        for k in SHAPE_KEYS
        if getattr(model_config, k, None) is not None
        and getattr(weights_config, k, None) is not None
        and getattr(model_config, k) != getattr(weights_config, k)
    ]
    if differ:
        msg = (
            f"weights_path {weights!r} holds another model than model_name {model!r} "
            f"(model_name vs weights_path: {'; '.join(differ)}); pass the weights saved from "
            f"this model, or set model_name to the model they belong to"
        )
        raise ValueError(msg)


def warn_if_untrained_head(source: str, missing_keys: Sequence[str], *, kind: str) -> None:
    """Warn (once per folder) when a reward model's score head was not in `source`: it starts
    from random values and its scores mean nothing until it is trained."""
    head = sorted(k for k in missing_keys if k.split(".")[0] in ("score", "classifier"))
    if not head or source in _WARNED_HEADS:
        return
    _WARNED_HEADS.add(source)
    log.warning(
        "reward_model_cfg (%s) is enabled but %r has no trained score head (%s not in the "
        "folder; e.g. a causal-LM folder): the head starts random, so score() returns noise "
        "until it is trained -- train it with PreferenceLoss (docs/reward-models.md) or point "
        "model_name at a trained reward model",
        kind,
        source,
        ", ".join(head),
    )

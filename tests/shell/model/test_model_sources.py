"""Model sources and constructor mistakes fail in one line naming what to change: an empty
folder, a folder without weights, a Hub id without a network, weights of another model,
`weight_path=`, and a model path where the config goes."""

from __future__ import annotations

import time

import pytest

from policyworker.errors import ConfigError
from policyworker.shell.model import sources
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_config


def test_an_empty_model_folder_is_named_with_what_it_lacks(tmp_path):
    with pytest.raises(
        ValueError,
        match=rf"model_name='{tmp_path}': that folder has no config.json \(it is empty\)",
    ):
        PolicyWorker(make_config(str(tmp_path)))


def test_a_folder_with_config_but_no_weights_is_named(tiny_model_paths, tmp_path):
    import shutil

    shutil.copy(f"{tiny_model_paths['llama']}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"has config.json but no weights"):
        PolicyWorker(make_config(str(tmp_path)))


def test_a_hub_id_in_offline_mode_fails_at_once_naming_hf_hub_offline():
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"HF_HUB_OFFLINE is set"):
        PolicyWorker(make_config("policyworker-tests/no-such-model"))
    assert time.monotonic() - start < 15


def test_a_hub_id_with_the_hub_unreachable_fails_fast_with_an_offline_hint(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    sources._reachable.cache_clear()
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"cannot be reached .* set HF_HUB_OFFLINE=1"):
        PolicyWorker(make_config("policyworker-tests/no-such-model"))
    assert time.monotonic() - start < 15
    sources._reachable.cache_clear()


def test_weights_of_another_model_are_refused_naming_both(tiny_model_paths, tmp_path):
    llama = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    llama.save_checkpoint(tmp_path / "ckpt", is_final_checkpoint=True)
    qwen3 = tiny_model_paths["qwen3"]
    with pytest.raises(ValueError, match=r"holds another model than model_name") as err:
        PolicyWorker(make_config(qwen3), weights_path=str(tmp_path / "ckpt"))
    assert str(tmp_path / "ckpt") in str(err.value) and repr(qwen3) in str(err.value)
    assert "model_type: 'qwen3' vs 'llama'" in str(err.value)


def test_a_misspelled_keyword_gets_a_did_you_mean(tiny_model_paths):
    with pytest.raises(ValueError, match=r"'weight_path' -> did you mean 'weights_path'\?"):
        PolicyWorker(make_config(tiny_model_paths["llama"]), weight_path="x")


def test_a_model_path_where_the_config_goes_hints_the_mapping(tiny_model_paths):
    path = tiny_model_paths["llama"]
    with pytest.raises(ConfigError, match=rf"pass PolicyWorker\(\{{'model_name': '{path}'\}}\)"):
        PolicyWorker(path)

"""The vLLM adapter without an engine: version pins, lazy import, metadata encoding, plugin."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from policyworker.errors import UnsupportedEngineError
from policyworker.shell.engines.vllm import (
    BACKEND_NAME,
    SUPPORTED_VLLM_VERSIONS,
    VllmRefit,
    check_vllm_version,
    decode_refit_info,
    encode_refit_info,
    engine_kwargs,
)
from tests.engines.vllm_helpers import require_vllm
from tests.helpers import child_env


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_the_tested_vllm_release_is_accepted_with_or_without_a_local_tag(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "0.32.1", "1.0.0"])
def test_other_vllm_releases_are_refused_by_name(version):
    with pytest.raises(UnsupportedEngineError) as info:
        check_vllm_version(version)
    assert f"vLLM {version} is not supported" in str(info.value)
    assert all(v in str(info.value) for v in SUPPORTED_VLLM_VERSIONS)
    assert "policyworker[vllm]" in str(info.value)


def test_importing_policyworker_and_the_adapter_does_not_import_vllm():
    code = (
        "import sys, policyworker, policyworker.shell.engines.vllm, policyworker.cli, "
        "policyworker.demo.loop; print('vllm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "False", out.stderr


def test_refit_info_travels_as_plain_lists_and_comes_back_equal():
    info = {
        "model.embed_tokens.weight": (torch.Size([128, 64]), torch.float32),
        "model.layers.0.mlp.gate.e_score_correction_bias": (torch.Size([4]), torch.float32),
        "lm_head.weight": (torch.Size([128, 64]), torch.bfloat16),
    }
    encoded = encode_refit_info(info)
    assert encoded["lm_head.weight"] == [[128, 64], "bfloat16"]
    assert decode_refit_info(encoded) == info


def test_an_unknown_dtype_name_is_refused_naming_the_tensor():
    with pytest.raises(ValueError, match=r"refit_info\['w'\] has dtype 'float7'"):
        decode_refit_info({"w": [[2], "float7"]})


def test_a_bad_via_or_timeout_is_refused_before_vllm_is_touched():
    with pytest.raises(ValueError, match="via='nccl'"):
        VllmRefit(object(), object(), via="nccl")
    with pytest.raises(ValueError, match="timeout_s 0"):
        VllmRefit(object(), object(), timeout_s=0)


def test_engine_kwargs_enable_the_backend_and_the_worker_extension():
    kwargs = engine_kwargs()
    assert kwargs["weight_transfer_config"] == {"backend": BACKEND_NAME}
    module, _, cls = kwargs["worker_extension_cls"].rpartition(".")
    assert module == "policyworker.shell.engines.vllm_worker"
    assert cls == "PolicyWorkerVllmExtension"


@pytest.mark.slow  # imports vLLM: 10-60 s on 2 cores
def test_the_vllm_plugin_entry_point_registers_the_backend_in_vllms_factory():
    require_vllm()
    plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["policyworker"].value == "policyworker.shell.engines.vllm:register_backend"
    assert plugins["policyworker"].load()() is True  # what vLLM runs in each of its processes
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from policyworker.shell.engines.vllm_worker import PolicyWorkerZmqEngine

    assert WeightTransferEngineFactory._registry[BACKEND_NAME]() is PolicyWorkerZmqEngine
    assert plugins["policyworker"].load()() is True  # idempotent: vLLM loads plugins repeatedly

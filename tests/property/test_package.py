"""The package's import is free of side effects and exposes the public names of API.md §1."""

import subprocess
import sys


def test_import_loads_neither_torch_nor_transformers():
    code = "import sys, policyworker; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_public_names_resolve():
    import policyworker

    assert policyworker.AutomodelPolicyWorker is policyworker.PolicyWorker
    assert callable(policyworker.load_config)
    assert policyworker.BatchedDataDict.__name__ == "BatchedDataDict"
    assert policyworker.PolicyConfig.__name__ == "PolicyConfig"


def test_every_exported_name_resolves_to_its_home_object():
    import importlib

    import policyworker

    for name in policyworker.__all__:
        value = getattr(policyworker, name)
        if name != "__version__":
            assert value is getattr(importlib.import_module(policyworker._LAZY[name]), name)
    from policyworker.errors import ConfigError
    from policyworker.functional.loss import ClippedPGLossFn
    from policyworker.shell.refit.receiver import HFWeightReceiver

    assert policyworker.HFWeightReceiver is HFWeightReceiver
    assert policyworker.ClippedPGLossFn is ClippedPGLossFn
    assert policyworker.ConfigError is ConfigError


def test_importing_the_shell_leaves_the_import_system_alone():
    code = (
        "import sys; n = len(sys.meta_path); import policyworker.shell.refit.zmq, "
        "policyworker.functional.wire.codec; print(len(sys.meta_path) == n)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"]


def test_the_ray_vllm_config_file_and_error_pieces_are_exported_without_loading_ray_or_vllm():
    code = (
        "import sys, policyworker\n"
        "names = ['RayWorkerGroup', 'make_placement_group', 'VllmRefit', 'load_config_file',\n"
        "         'CheckpointError', 'WorkerGroupError', 'WorkerGroupTimeoutError',\n"
        "         'UnsupportedEngineError']\n"
        "assert all(n in policyworker.__all__ for n in names)\n"
        "print('ray' in sys.modules, 'vllm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]

    import policyworker
    from policyworker.config import files
    from policyworker.shell import checkpoint, ray
    from policyworker.shell.engines import vllm

    assert policyworker.RayWorkerGroup is ray.RayWorkerGroup
    assert policyworker.make_placement_group is ray.make_placement_group
    assert policyworker.VllmRefit is vllm.VllmRefit
    assert policyworker.load_config_file is files.load_config_file
    assert policyworker.CheckpointError is checkpoint.CheckpointError
    assert issubclass(policyworker.WorkerGroupTimeoutError, policyworker.WorkerGroupError)


def test_every_exported_name_has_a_section_in_the_api_docs():
    from pathlib import Path

    import policyworker

    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for name in ("RayWorkerGroup", "make_placement_group", "VllmRefit", "load_config_file"):
        assert f"### `{name}" in api, name
    for name in ("CheckpointError", "WorkerGroupError", "UnsupportedEngineError"):
        assert f"### `{name}`" in api and name in policyworker.__all__

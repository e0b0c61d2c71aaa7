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

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


def test_moved_modules_keep_their_old_import_paths():
    """API.md names `policyworker.shell.receiver`, `.params` and `.transports.*`: an old path
    imports the very module object of its new room (so patching one patches both)."""
    import importlib

    from policyworker.shell import MOVED

    for old, new in MOVED.items():
        module = importlib.import_module(old)
        if new is not None:
            assert module is importlib.import_module(new)
            assert module.__spec__.name == new
    from policyworker.shell.params import params_generator
    from policyworker.shell.receiver import HFWeightReceiver
    from policyworker.shell.transports import ipc_logits

    from policyworker.shell.parallel import parallelize_model
    from policyworker.shell.refit import RefitSender

    assert HFWeightReceiver.__module__ == "policyworker.shell.refit.receiver"
    assert params_generator.__module__ == "policyworker.shell.refit.params"
    assert RefitSender.__module__ == "policyworker.shell.refit.sender"
    assert parallelize_model.__module__ == "policyworker.shell.parallel.plans"
    assert ipc_logits.__name__ == "policyworker.shell.ipc_logits"


def test_unknown_module_under_a_moved_package_names_the_rooms():
    import pytest

    with pytest.raises(ModuleNotFoundError, match="moved"):
        __import__("policyworker.shell.transports.no_such_module")

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

"""Package faces built by `policyworker._lazy.lazy_exports` import a module only when one of its
names is asked for, and refuse names they do not export."""

import subprocess
import sys

import pytest

from policyworker._lazy import lazy_exports


def test_a_name_resolves_once_and_an_unknown_one_is_an_attribute_error():
    resolve, names = lazy_exports(__name__, {"dumps": "json", "Path": "pathlib"})
    assert names == ["Path", "dumps"]
    import json

    assert resolve("dumps") is json.dumps and globals()["dumps"] is json.dumps
    with pytest.raises(AttributeError, match="has no attribute 'loads'"):
        resolve("loads")


def test_importing_a_face_imports_none_of_its_modules():
    code = (
        "import sys, policyworker.shell.parallel as p\n"
        "assert 'policyworker.shell.parallel.plans' not in sys.modules\n"
        "p.parallelize_model\n"
        "assert 'policyworker.shell.parallel.plans' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

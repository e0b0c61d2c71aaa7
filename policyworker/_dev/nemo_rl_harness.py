"""Run NeMo-RL's own unit tests of the loss functions, `BatchedDataDict`, the packing
algorithms and the config loader against policyworker, with only their imports redirected.

    python -m policyworker._dev.nemo_rl_harness <NeMo-RL checkout or bare git dir> [--keep]

The test files are read from the given NeMo-RL snapshot (a checkout, or a git directory read at
HEAD) into a temporary folder, never into this project. A `conftest.py` written beside them
installs an import hook: every `nemo_rl.*` module is made on demand, and each name imported
from it is looked up in `policyworker.nemo_rl` (the NeMo-RL-named faces); a name with no face
becomes a stand-in that raises NotImplementedError when used, so one missing name fails only
the tests that use it. Without CUDA, tensors and modules sent to "cuda" stay on the CPU and the
test modules' own `torch.cuda.is_available()` reads True (policyworker's does not). Prints
passed/failed/errors/skipped per test file and exits 0 (a report, not a gate).

    python -m policyworker._dev.nemo_rl_harness <snapshot> --losses

extracts NeMo-RL's loss package (`nemo_rl/algorithms/loss/*.py`, verbatim) instead, as a real
`nemo_rl.algorithms.loss` package whose other `nemo_rl` imports the same hook resolves, and
trains a tiny model through `PolicyWorker.train` with its `NLLLossFn`, `ClippedPGLossFn` and
`DPOLossFn` (policyworker._dev.nemo_rl_losses): one line per loss, trained or failed and why.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

# NeMo-RL's unit tests of the surfaces policyworker faces (paths inside its repository).
TEST_FILES: tuple[str, ...] = (
    "tests/unit/algorithms/test_loss_functions.py",
    "tests/unit/distributed/test_batched_data_dict.py",
    "tests/unit/data/packing/test_algorithms.py",
    "tests/unit/utils/test_config.py",
)
# NeMo-RL's loss package, extracted whole for `--losses`.
LOSS_PACKAGE = "nemo_rl/algorithms/loss"
_GIT_TIMEOUT_S = 60
_PYTEST_TIMEOUT_S = 1800

HOOK = '''
"""Written by policyworker._dev.nemo_rl_harness: nemo_rl imports resolve to policyworker,
but for NeMo-RL modules extracted beside this file, which are imported as they are."""
import importlib.abc
import importlib.machinery
import os
import sys
import types

import policyworker.nemo_rl as faces
import policyworker.nemo_rl.loss as loss_faces


class _NoFace:
    """A NeMo-RL name policyworker has no face for: fails when used, not when imported."""

    def __init__(self, where):
        object.__setattr__(self, "_where", where)

    def _fail(self, *args, **kwargs):
        raise NotImplementedError(f"{self._where} has no policyworker face")

    __call__ = _fail

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._fail()

    def __mro_entries__(self, bases):
        self._fail()


def _resolve(module, name):
    for space in (faces, loss_faces):
        if hasattr(space, name):
            return getattr(space, name)
    if name.startswith("__"):
        raise AttributeError(name)
    return _NoFace(f"{module}.{name}")


_HERE = os.path.dirname(os.path.abspath(__file__))


def _on_disk(fullname):
    return os.path.join(_HERE, *fullname.split("."))


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname != "nemo_rl" and not fullname.startswith("nemo_rl."):
            return None
        where = _on_disk(fullname)
        if os.path.isfile(where + ".py") or os.path.isfile(os.path.join(where, "__init__.py")):
            return None  # an extracted NeMo-RL module: the path finder imports it as it is
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        where = _on_disk(spec.name)
        # a folder holding extracted modules is searched for them
        module.__path__ = [where] if os.path.isdir(where) else []
        module.__getattr__ = lambda name, _m=spec.name: _resolve(_m, name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _ShimFinder())
'''

CONFTEST = (
    HOOK
    + '''
import torch

if not torch.cuda.is_available():
    def _is_cuda(device):
        return device is not None and str(device).startswith("cuda")

    _to = torch.Tensor.to

    def _tensor_to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return _to(self, *args, **kwargs)

    torch.Tensor.to = _tensor_to
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    for _name in (
        "tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
        "randperm", "eye", "linspace", "zeros_like", "ones_like", "full_like", "rand_like",
        "randn_like", "empty_like", "as_tensor",
    ):
        _fn = getattr(torch, _name)

        def _on_cpu(*args, _fn=_fn, **kwargs):
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return _fn(*args, **kwargs)

        setattr(torch, _name, _on_cpu)

    class _CudaSeenAsPresent:
        """`torch.cuda` as the test modules see it: available (their "cuda" is the CPU)."""

        def __getattr__(self, name):
            if name == "is_available":
                return lambda: True
            return getattr(torch.cuda, name)

    class _TorchForTests:
        def __getattr__(self, name):
            return _CUDA_FOR_TESTS if name == "cuda" else getattr(torch, name)

    _CUDA_FOR_TESTS = _CudaSeenAsPresent()

    def pytest_collection_modifyitems(items):
        # Only the NeMo-RL test modules' own `torch` name changes; policyworker sees no CUDA.
        for item in items:
            module = getattr(item, "module", None)
            if module is not None and getattr(module, "torch", None) is torch:
                module.torch = _TorchForTests()
'''
)


def read_snapshot_file(source: Path, path: str) -> str:
    """`path` of a NeMo-RL checkout, or of a bare git directory at HEAD.

    Raises:
        FileNotFoundError: the snapshot has no such file.
    """
    if (source / path).is_file():
        return (source / path).read_text()
    if (source / "HEAD").is_file() and (source / "objects").is_dir():
        shown = subprocess.run(
            ["git", f"--git-dir={source}", "show", f"HEAD:{path}"],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
        if shown.returncode == 0:
            return shown.stdout
    msg = f"{path} is not in the NeMo-RL snapshot {source}; pass a checkout or its git directory"
    raise FileNotFoundError(msg)


def list_snapshot_folder(source: Path, folder: str) -> list[str]:
    """The `.py` files directly in `folder` of a NeMo-RL checkout or bare git directory (paths
    inside the repository, sorted); [] when the snapshot has no such folder."""
    if (source / folder).is_dir():
        return sorted(f"{folder}/{p.name}" for p in (source / folder).glob("*.py"))
    if (source / "HEAD").is_file() and (source / "objects").is_dir():
        listed = subprocess.run(
            ["git", f"--git-dir={source}", "ls-tree", "--name-only", "HEAD", f"{folder}/"],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
        return sorted(p for p in listed.stdout.splitlines() if p.endswith(".py"))
    return []


def extract_losses(source: Path, into: Path) -> list[str]:
    """Write NeMo-RL's loss package (`nemo_rl/algorithms/loss/*.py`, verbatim) and the import
    hook (`nemo_rl_hook.py`) under `into`; return the files written.

    Raises:
        FileNotFoundError: the snapshot has no loss package.
    """
    paths = list_snapshot_folder(source, LOSS_PACKAGE)
    if f"{LOSS_PACKAGE}/loss_functions.py" not in paths:
        msg = (
            f"{LOSS_PACKAGE}/loss_functions.py is not in the NeMo-RL snapshot {source}; pass a "
            "checkout or its git directory"
        )
        raise FileNotFoundError(msg)
    into.mkdir(parents=True, exist_ok=True)
    (into / "nemo_rl_hook.py").write_text(HOOK)
    for path in paths:
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(read_snapshot_file(source, path))
    if f"{LOSS_PACKAGE}/__init__.py" not in paths:  # still a package, as in NeMo-RL
        (into / LOSS_PACKAGE / "__init__.py").write_text("")
    return paths


def run_losses(source: Path, workdir: Path) -> list[str]:
    """Extract NeMo-RL's loss package into `workdir` and train a tiny model through
    `PolicyWorker.train` with each of `nemo_rl_losses.LOSSES` in a fresh Python; return its
    lines (one per loss: trained or failed, and why)."""
    extract_losses(source, workdir)
    runner = workdir / "run_losses.py"
    runner.write_text(
        "import nemo_rl_hook  # noqa: F401  (installs the nemo_rl import hook)\n"
        "from policyworker._dev.nemo_rl_losses import main\n"
        "raise SystemExit(main())\n"
    )
    done = subprocess.run(
        [sys.executable, str(runner)],
        cwd=workdir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=_PYTEST_TIMEOUT_S,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        lines.append(f"the loss run exited {done.returncode}: {tail[0]}")
    return lines


def _env() -> dict[str, str]:
    # The policyworker running this harness is the one tested, whatever is installed.
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": path}


def extract(source: Path, into: Path) -> list[str]:
    """Write the test files and the shim conftest under `into`; return the files written."""
    into.mkdir(parents=True, exist_ok=True)
    (into / "conftest.py").write_text(CONFTEST)
    written = []
    for path in TEST_FILES:
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(read_snapshot_file(source, path))
        written.append(path)
    return written


def count_outcomes(junit_xml: Path) -> dict[str, Counter[str]]:
    """{test file: Counter(passed/failed/errors/skipped)} from a pytest JUnit report."""
    counts: dict[str, Counter[str]] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        # a test's classname starts with its file's dotted path; a file that failed to import
        # is reported as one case named by its dotted path
        names = (case.get("classname", ""), case.get("name", ""))
        path = next((p for p in TEST_FILES for n in names if n.startswith(_dotted(p))), names[0])
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors"}.get(child.tag, child.tag)
        counts.setdefault(path, Counter())[outcome] += 1
    return counts


def _dotted(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def run(source: Path, workdir: Path, pytest_args: list[str]) -> dict[str, Counter[str]]:
    """Extract the tests into `workdir`, run pytest on them, return the counts per file."""
    extract(source, workdir)
    report = workdir / "report.xml"
    env = _env()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            "--continue-on-collection-errors",
            f"--rootdir={workdir}",
            f"--junitxml={report}",
            *pytest_args,
            *[str(workdir / p) for p in TEST_FILES],
        ],
        cwd=workdir,
        env=env,
        timeout=_PYTEST_TIMEOUT_S,
        check=False,
    )
    return count_outcomes(report) if report.exists() else {}


def format_counts(counts: dict[str, Counter[str]]) -> str:
    """One line per file: passed/total, then failed, errors, skipped."""
    lines = []
    for path in TEST_FILES:
        c = counts.get(path, Counter())
        total = sum(c.values())
        lines.append(
            f"{path}: {c['passed']}/{total} passed, {c['failed']} failed, "
            f"{c['errors']} errors, {c['skipped']} skipped"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("source", type=Path, help="NeMo-RL checkout or bare git directory")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument(
        "--losses",
        action="store_true",
        help="train through PolicyWorker.train with NeMo-RL's own loss classes instead",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="nemo_rl_harness_"))
    try:
        if args.losses:
            print("\n".join(run_losses(args.source, workdir)))
        else:
            print(format_counts(run(args.source, workdir, args.pytest_args)))
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The functional core imports nothing effectful and reads no runtime state."""

import ast
import pathlib

import pytest

import policyworker.functional

CORE = pathlib.Path(policyworker.functional.__file__).parent
FORBIDDEN_IMPORTS = (
    "torch.distributed",
    "zmq",
    "os",
    "ray",
    "safetensors",
    "transformers",
    "policyworker.shell",
    "subprocess",
    "socket",
)
FORBIDDEN_CALLS = {
    "getenv",
    "device_count",
    "is_available",
    "get_rank",
    "get_world_size",
    "environ",
}


def _violations(source: str, filename: str) -> list[str]:
    problems = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN_IMPORTS):
                problems.append(
                    f"{filename}:{node.lineno} imports {name}; "
                    f"move the effect to policyworker/shell/"
                )
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_CALLS:
            problems.append(
                f"{filename}:{node.lineno} reads runtime state via .{node.attr}; pass it in"
            )
    return problems


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_has_no_side_effecting_dependencies(path):
    assert _violations(path.read_text(), path.name) == []


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist",
        "from os import environ",
        "import zmq",
        "x = torch.cuda.device_count()",
    ],
)
def test_checker_catches_effectful_code(source):
    assert _violations(source, "probe.py")


# ------------------------------------------------------------------------------ purity by effect
#
# The checks above look at import names only. The ones below resolve every dotted name through
# the file's own import aliases (`import torch as t; t.distributed.all_reduce(...)` is
# `torch.distributed.all_reduce`) and refuse what the core must not *do*: talk to other
# processes or devices, touch the global RNG, read clocks, log, open files or the environment,
# import the shell (also relatively or dynamically). Every file under functional/ is checked,
# subfolders included.

EFFECTFUL_NAMES = (
    "torch.distributed",
    "torch.cuda",
    "torch.manual_seed",
    "torch.seed",
    "torch.initial_seed",
    "torch.random",
    "torch.set_rng_state",
    "torch.get_rng_state",
    "time",
    "datetime",
    "logging",
    "warnings",
    "os",
    "sys",
    "pathlib",
    "shutil",
    "tempfile",
    "io",
    "importlib",
    "policyworker.shell",
)
EFFECTFUL_BUILTINS = {"open", "print", "input", "breakpoint", "exec", "eval", "__import__"}
# Sampling functions that use the global RNG unless they are handed a `generator=`.
GLOBAL_RNG_SAMPLERS = {
    "torch.rand",
    "torch.randn",
    "torch.randint",
    "torch.randperm",
    "torch.bernoulli",
    "torch.multinomial",
    "torch.normal",
    "torch.poisson",
    "torch.rand_like",
    "torch.randn_like",
    "torch.randint_like",
}
# The global RNG modules: only a locally seeded generator may be built from them.
RNG_MODULES = ("random", "numpy.random")
LOCAL_RNG_CONSTRUCTORS = {"random.Random", "numpy.random.default_rng"}
GLOBAL_RNG_METHODS = {
    "uniform_",
    "normal_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "random_",
}


def _module_of(path: pathlib.Path) -> str:
    rel = path.relative_to(CORE.parent.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _matches(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def effect_violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """What the code at `module` does that the functional core must not (empty: pure)."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
                if _matches(alias.name, EFFECTFUL_NAMES):
                    problems.append(f"line {node.lineno}: imports {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                aliases[alias.asname or alias.name] = full
                if (
                    _matches(full, EFFECTFUL_NAMES)
                    or _matches(base, EFFECTFUL_NAMES)
                    or (
                        _matches(full, RNG_MODULES)
                        and full not in LOCAL_RNG_CONSTRUCTORS
                        and full not in RNG_MODULES
                    )
                ):
                    problems.append(f"line {node.lineno}: imports {full}")
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute | ast.Name)
            and id(node) not in inner
            and not isinstance(getattr(node, "ctx", None), ast.Store)
        ):
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                full = ".".join([aliases[parts[0]], *parts[1:]])
                if _matches(full, EFFECTFUL_NAMES) or (
                    _matches(full, RNG_MODULES) and full not in LOCAL_RNG_CONSTRUCTORS
                ):
                    problems.append(f"line {node.lineno}: uses {full}")
        if isinstance(node, ast.Call):
            parts = _dotted(node.func)
            full = ".".join([aliases.get(parts[0], parts[0]), *parts[1:]]) if parts else ""
            keywords = {k.arg for k in node.keywords}
            if isinstance(node.func, ast.Name) and node.func.id in EFFECTFUL_BUILTINS:
                problems.append(f"line {node.lineno}: calls {node.func.id}()")
            elif full in LOCAL_RNG_CONSTRUCTORS and not node.args and not keywords:
                problems.append(f"line {node.lineno}: {full}() without a seed (OS entropy)")
            elif full in GLOBAL_RNG_SAMPLERS and "generator" not in keywords:
                problems.append(f"line {node.lineno}: {full}() without generator= (global RNG)")
            elif (
                isinstance(node.func, ast.Attribute)
                and node.func.attr in GLOBAL_RNG_METHODS
                and "generator" not in keywords
            ):
                problems.append(f"line {node.lineno}: .{node.func.attr}() without generator=")
    return sorted(set(problems))


CORE_FILES = sorted(CORE.rglob("*.py"))


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_does_nothing_effectful(path):
    module = _module_of(path)
    problems = effect_violations(path.read_text(), module, is_package=path.name == "__init__.py")
    assert problems == [], f"{path.relative_to(CORE.parent)}: {problems}; move it to the shell"


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ndef f(x):\n    torch.distributed.all_reduce(x)",
        "import torch as t\ndef f():\n    return t.cuda.current_device()",
        "import torch\ntorch.manual_seed(0)",
        "import torch\ndef f(n):\n    return torch.randn(n)",
        "def f(x):\n    return x.normal_()",
        "import random\ndef f():\n    return random.random()",
        "import numpy as np\ndef f():\n    return np.random.rand()",
        "from numpy import random\nrandom.rand()",
        "from random import shuffle\n",
        "import random\ndef f():\n    return random.Random()",
        "import time\ndef f():\n    return time.monotonic()",
        "import logging\nlog = logging.getLogger(__name__)",
        "def f(p):\n    return open(p).read()",
        "def f(x):\n    print(x)",
        "import os\n",
        "from ..shell import worker\n",
        "from ..shell.refit import wire\n",
        "from policyworker.shell import model\n",
        "import importlib\ndef f():\n    return importlib.import_module('policyworker.shell')",
    ],
)
def test_effect_checker_catches_what_the_core_must_not_do(source):
    assert effect_violations(source, "policyworker.functional.probe")


def test_effect_checker_lets_pure_code_through():
    source = (
        "import math\nimport torch\nfrom policyworker.functional.padding import mask_from_lengths\n"
        "from . import padding\nimport random\n"
        "def g(seed):\n    return random.Random(seed).random()\n"
        "def f(x, g):\n    return torch.randn(3, generator=g) + torch.log_softmax(x, -1)\n"
    )
    assert effect_violations(source, "policyworker.functional.probe") == []


# ------------------------------------------------------------------------------ layers as folders
#
# The package imports one way: cli / demo / _dev -> shell/ray -> shell/worker (the facade above
# its behaviours, above the worker's mechanisms) -> the shell's other folders -> config -> the
# core -> errors. A module may import its own layer or a lower one, never a higher one, and the
# package's import graph (lazy imports inside functions and package faces included) has no cycle.

PACKAGE = CORE.parent
SHELL = PACKAGE / "shell"
FACADE = "policyworker.shell.worker.policy_worker"
BEHAVIOURS = {
    f"policyworker.shell.worker.{name}"
    for name in (
        "training",
        "inference",
        "calibration",
        "offload",
        "offload_calls",
        "refit_calls",
        "split_step",
        "nemo_rl_surface",
    )
}
LAYER_NAMES = {
    5: "actors",
    4: "facade",
    3: "behaviours",
    2: "worker mechanisms",
    1: "mechanisms",
    0: "core",
}


def _layer(module: str) -> int | None:
    """The layer of a shell module (0 for the package outside the shell, None if not ours)."""
    if not module.startswith("policyworker"):
        return None
    if not _matches(module, ["policyworker.shell"]):
        return 0
    if _matches(module, ["policyworker.shell.ray"]):
        return 5
    if module == FACADE:
        return 4
    if module in BEHAVIOURS:
        return 3
    if _matches(module, ["policyworker.shell.worker"]):
        return 2
    return 1


def _imports_of(root: pathlib.Path) -> dict[str, set[str]]:
    """{module under root: policyworker modules it imports anywhere in its file}."""
    graph = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_of(path)
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, module, path.name == "__init__.py")
                targets.add(base)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    # `from pkg import module` names a module; `from module import name` does not
                    file = PACKAGE.parent / full.replace(".", "/")
                    if file.with_suffix(".py").exists() or (file / "__init__.py").exists():
                        targets.add(full)
        graph[module] = {t for t in targets if t.startswith("policyworker") and t != module}
    return graph


def _with_parent_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing `a.b.c` runs `a/__init__` and `a/b/__init__` first: those faces are edges too
    (except a module's own parents, which are running already when it is imported; a module that
    names its own parent explicitly imports that face, which is an edge)."""
    closed = {}
    for module, targets in graph.items():
        edges = set(targets)
        for target in targets:
            parts = target.split(".")
            for i in range(2, len(parts)):
                parent = ".".join(parts[:i])
                if not module.startswith(parent + "."):
                    edges.add(parent)
        closed[module] = {t for t in edges if t in graph and t != module}
    return closed


def test_every_shell_module_has_a_layer():
    assert [m for m in _imports_of(SHELL) if _layer(m) is None] == []


def layer_problems(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a higher layer than the importer's own."""
    problems = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            own, theirs = _layer(module), _layer(target)
            if own is not None and theirs is not None and theirs > own:
                problems.append(
                    f"{module} ({LAYER_NAMES[own]}) imports {target} ({LAYER_NAMES[theirs]})"
                )
    return problems


def folder_problems(graph: dict[str, set[str]]) -> list[str]:
    """The rules between folders that the layers alone do not say."""
    rules = [
        (["policyworker.functional"], ["policyworker.functional", "policyworker.errors"], True),
        (
            ["policyworker.shell.model", "policyworker.shell.kernels"],
            ["policyworker.shell.worker"],
            False,
        ),
        (
            ["policyworker.shell.worker"],
            ["policyworker.shell.ray", "policyworker.shell.engines"],
            False,
        ),
        (["policyworker.config"], ["policyworker.shell"], False),
    ]
    problems = []
    for module, targets in sorted(graph.items()):
        for importers, named, only in rules:
            if not _matches(module, importers):
                continue
            for target in sorted(targets):
                if _matches(target, named) != only:
                    problems.append(f"{module} imports {target}")
    return problems


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph among its own modules ([] when there is none)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return []

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return []


def test_shell_modules_import_only_their_own_layer_or_lower():
    assert layer_problems(_imports_of(SHELL)) == []


def test_folders_keep_their_import_rules():
    assert folder_problems(_imports_of(PACKAGE)) == []


def test_package_import_graph_has_no_cycle_faces_included():
    assert import_cycle(_with_parent_packages(_imports_of(PACKAGE))) == []


def test_layering_checks_catch_upward_imports_folder_breaks_and_cycles():
    graph = _imports_of(PACKAGE)
    assert "policyworker.shell.worker.training" in graph[FACADE]
    assert "policyworker.shell.checkpoint" in graph[FACADE]
    upward = {"policyworker.shell.worker.state": {"policyworker.shell.worker.training"}}
    assert layer_problems(upward) == [
        "policyworker.shell.worker.state (worker mechanisms) imports "
        "policyworker.shell.worker.training (behaviours)"
    ]
    assert folder_problems(
        {
            "policyworker.functional.batching": {"policyworker.config"},
            "policyworker.shell.model.lora": {"policyworker.shell.worker.state"},
            "policyworker.shell.worker.training": {"policyworker.shell.engines.vllm"},
        }
    ) == [
        "policyworker.functional.batching imports policyworker.config",
        "policyworker.shell.model.lora imports policyworker.shell.worker.state",
        "policyworker.shell.worker.training imports policyworker.shell.engines.vllm",
    ]
    # a child that imports its own package's face closes a loop through the face
    faces = {
        "policyworker.shell.checkpoint": {"policyworker.shell.checkpoint.dcp"},
        "policyworker.shell.checkpoint.dcp": {"policyworker.shell.checkpoint.layout"},
        "policyworker.shell.checkpoint.layout": set(),
    }
    assert import_cycle(_with_parent_packages(faces)) == []
    faces["policyworker.shell.checkpoint.dcp"].add("policyworker.shell.checkpoint")
    assert import_cycle(_with_parent_packages(faces)) == [
        "policyworker.shell.checkpoint",
        "policyworker.shell.checkpoint.dcp",
        "policyworker.shell.checkpoint",
    ]


# ----------------------------------------------------------------------------- module size

MAX_MODULE_LINES = 500


def long_modules(package: pathlib.Path) -> list[str]:
    """Modules under `package` over the limit."""
    return [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if len(path.read_text().splitlines()) > MAX_MODULE_LINES
    ]


def test_no_module_is_over_the_limit():
    assert long_modules(PACKAGE) == [], "split it by responsibility"


def test_size_check_catches_a_long_module(tmp_path):
    (tmp_path / "long.py").write_text('"""Long."""\n' + "x = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "short.py").write_text('"""Short."""\nx = 1\n')
    assert long_modules(tmp_path) == ["long.py"]


# ------------------------------------------------------------------------------ bench/

BENCH = PACKAGE.parent / "bench"


def _is_face(module: str) -> bool:
    """A package of ours (an `__init__.py`), not one of its modules, nor the dev tools."""
    folder = PACKAGE.parent / module.replace(".", "/")
    return (folder / "__init__.py").is_file() and not _matches(module, ["policyworker._dev"])


def _face_exports(module: str) -> set[str]:
    import importlib

    return set(getattr(importlib.import_module(module), "__all__", ()))


def _public(module: str, names: list[str]) -> bool:
    """Whether `from module import names` uses only public faces: the core's modules and the
    test builder are public as they are; anything else must be a package face exporting the
    names (or a name that is itself a face)."""
    if _matches(module, ["policyworker.functional", "policyworker.testing"]):
        return True
    if not _is_face(module):
        return False
    exported = _face_exports(module)
    return all(n in exported or _is_face(f"{module}.{n}") for n in names)


def bench_import_problems(root: pathlib.Path) -> list[str]:
    """Imports of the library's internals and `sys.path` edits in the modules under `root`."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        found: list[tuple[int, str]] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [
                    (node.lineno, f"imports {a.name}")
                    for a in node.names
                    if a.name.startswith("policyworker") and not _public(a.name, [])
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "policyworker"
            ):
                names = [a.name for a in node.names]
                if not _public(node.module or "", names):
                    found.append((node.lineno, f"imports {names} from {node.module}"))
            elif isinstance(node, ast.Attribute) and _dotted(node) == ["sys", "path"]:
                found.append((node.lineno, "edits sys.path"))
        problems += [f"{path.relative_to(root)}:{line} {what}" for line, what in sorted(found)]
    return problems


def test_bench_imports_only_public_faces():
    assert bench_import_problems(BENCH) == [], "export the name from a package face"


def test_bench_import_check_catches_internals_and_path_edits(tmp_path):
    (tmp_path / "ok.py").write_text(
        "import policyworker\n"
        "from policyworker import PolicyWorker\n"
        "from policyworker.functional.buckets import align_up\n"
        "from policyworker.shell import checkpoint\n"
        "from policyworker.shell.refit.zmq import ShmStaging\n"
    )
    (tmp_path / "bad.py").write_text(
        "import sys\n"
        "sys.path.insert(0, '.')\n"
        "from policyworker.shell.refit.sender import RefitSender\n"
        "from policyworker.shell.checkpoint import layout\n"
        "import policyworker.shell.worker.policy_worker\n"
    )
    assert bench_import_problems(tmp_path) == [
        "bad.py:2 edits sys.path",
        "bad.py:3 imports ['RefitSender'] from policyworker.shell.refit.sender",
        "bad.py:4 imports ['layout'] from policyworker.shell.checkpoint",
        "bad.py:5 imports policyworker.shell.worker.policy_worker",
    ]


def test_no_bench_module_is_over_the_limit():
    assert long_modules(BENCH) == [], "split it by responsibility"

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
FORBIDDEN_CALLS = {"getenv", "device_count", "is_available", "get_rank", "get_world_size", "environ"}


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
                    f"{filename}:{node.lineno} imports {name}; move the effect to policyworker/shell/"
                )
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_CALLS:
            problems.append(f"{filename}:{node.lineno} reads runtime state via .{node.attr}; pass it in")
    return problems


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_module_has_no_side_effecting_dependencies(path):
    assert _violations(path.read_text(), path.name) == []


@pytest.mark.parametrize(
    "source",
    ["import torch.distributed as dist", "from os import environ", "import zmq", "x = torch.cuda.device_count()"],
)
def test_checker_catches_effectful_code(source):
    assert _violations(source, "probe.py")

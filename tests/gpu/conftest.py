"""Fixtures of tests/gpu: the CPU shell tests' tiny checkpoints, shared (session scope)."""

from tests.shell import conftest as shell_conftest

# pytest collects fixtures by attribute name from a conftest; re-exporting the shell fixture
# here (instead of importing it into each test module) keeps one session-scoped instance.
tiny_model_paths = shell_conftest.tiny_model_paths

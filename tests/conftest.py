"""Shared test configuration: GPU auto-skip and hypothesis profiles."""

import os

import pytest
import torch
from hypothesis import HealthCheck, Verbosity, settings

# Tiny models gain nothing from intra-op threads on 2 cores, and OpenMP contention between the
# test process and the processes it spawns halves throughput (measured on the CI machine kind).
torch.set_num_threads(1)

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("debug", max_examples=10, verbosity=Verbosity.verbose, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count()
    for item in items:
        if "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA devices, found {num_gpus}"))

"""torch.optim.Adafactor under a process group (FSDP2 shards the parameters even at world size
1) is refused when the worker is built, naming the optimizer and the fix, instead of failing in
its first step inside DTensor."""

import pytest
import torch

from tests.distributed.launch import run_on_gloo
from tests.helpers import save_tiny_llama

pytestmark = pytest.mark.distributed


def _refused_under_fsdp2(rank, world_size, path):
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.shell.conftest import make_config

    optimizer = {"name": "torch.optim.Adafactor", "kwargs": {"lr": 1e-2}}
    with pytest.raises(ValueError, match=r"'torch\.optim\.Adafactor' cannot step FSDP2"):
        PolicyWorker(make_config(path, optimizer=optimizer), init_reference_model=False)


def test_adafactor_is_refused_at_construction_under_fsdp2(tmp_path):
    torch.set_num_threads(1)
    save_tiny_llama(tmp_path / "llama")
    run_on_gloo(_refused_under_fsdp2, 1, str(tmp_path / "llama"))

"""Several LoRA adapters on one base under gloo: dp2 (FSDP2) and tp2 equal single-adapter
workers bit for bit, and an adapter-only refit gathers and sends the full adapter. One spawn
runs both layouts."""

import pytest
import torch

from tests.distributed import adapter_workers
from tests.distributed.launch import run_on_gloo
from tests.helpers import save_tiny_llama

pytestmark = pytest.mark.distributed


def test_adapters_under_dp2_and_tp2_equal_single_adapter_workers(tmp_path):
    torch.set_num_threads(1)
    save_tiny_llama(tmp_path / "llama")
    run_on_gloo(adapter_workers.adapters_equal_single_workers, 2, str(tmp_path / "llama"))

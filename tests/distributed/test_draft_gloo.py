"""Draft co-training under gloo dp2 (FSDP2 policy, replicated draft) == one process on the
whole batch, for fixed and packed batching (rank 1 runs a dummy microbatch under packing): the
global draft loss of each step, the draft's weights after the steps (equal on both ranks, though
each rank drew a different fresh draft); a dp2 checkpoint loads into one process with that
draft. One spawn runs every check."""

import pytest
import torch

from tests.distributed import draft_workers
from tests.distributed.launch import run_on_gloo
from tests.helpers import save_tiny_llama

pytestmark = pytest.mark.distributed


def test_draft_training_under_dp2_matches_one_process(tmp_path):
    torch.set_num_threads(1)
    save_tiny_llama(tmp_path / "llama")
    want = draft_workers.draft_reference(str(tmp_path / "llama"))
    run_on_gloo(draft_workers.draft_dp2, 2, str(tmp_path / "llama"), want, str(tmp_path / "ckpt"))

"""Checkpoints: HF safetensors weights, DCP optimizer state, an atomic commit across ranks.

    layout.py           folder and file names, the HF tensor boxes, safetensors file plans
    folders.py          what a folder holds: complete safetensors files, the weights format
    safetensors_io.py   staging and `pwrite` of HF safetensors weights (the save)
    safetensors_load.py validation and loading of HF safetensors weights
    dcp.py              saving optimizer, scheduler and RNG state via torch DCP
    dcp_load.py         loading them (and DCP-format weights), with the fit checks
    commit.py           fsync, commit records, renames, recovery of interrupted commits
    saver.py            AsyncSaver: the background writes of one save and their commit
    load.py             the worker-level load: digests checked beside the reads, one commit
    api.py              save_checkpoint / load_checkpoint / finalize_async_save on a worker's
                        state (`CheckpointOwner`)

Dependencies run down this list's reverse: api -> load -> dcp_load -> dcp, safetensors_load
-> safetensors_io -> saver -> folders -> commit -> layout. The names below are the package's
public surface (docs/checkpoints.md).
"""

from policyworker.shell.checkpoint.api import (
    CheckpointOwner,
    finalize_async_save,
    load_checkpoint,
    load_checkpoint_at_init,
    save_checkpoint,
)
from policyworker.shell.checkpoint.commit import COMMIT_RECORD_PREFIX, recover_checkpoint_commits
from policyworker.shell.checkpoint.dcp import save_optimizer
from policyworker.shell.checkpoint.dcp_load import load_optimizer
from policyworker.shell.checkpoint.digests import verify_digests, write_digests
from policyworker.shell.checkpoint.folders import detect_weights_format, validate_hf_folder
from policyworker.shell.checkpoint.layout import (
    INDEX_FILE,
    MANIFEST_FILE,
    MAX_FILE_BYTES,
    MODEL_DIR,
    OPTIM_DIR,
    REFERENCE_DIR,
    CheckpointError,
    HFTensor,
    hf_layout,
    plan_safetensors_files,
)
from policyworker.shell.checkpoint.safetensors_io import save_hf_weights
from policyworker.shell.checkpoint.safetensors_load import load_hf_weights
from policyworker.shell.checkpoint.saver import FINALIZE_TIMEOUT_S, AsyncSaver, on_threads

__all__ = [
    "COMMIT_RECORD_PREFIX",
    "FINALIZE_TIMEOUT_S",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "MAX_FILE_BYTES",
    "MODEL_DIR",
    "OPTIM_DIR",
    "REFERENCE_DIR",
    "AsyncSaver",
    "CheckpointError",
    "CheckpointOwner",
    "HFTensor",
    "detect_weights_format",
    "finalize_async_save",
    "hf_layout",
    "load_checkpoint",
    "load_checkpoint_at_init",
    "load_hf_weights",
    "load_optimizer",
    "on_threads",
    "plan_safetensors_files",
    "recover_checkpoint_commits",
    "save_checkpoint",
    "save_hf_weights",
    "save_optimizer",
    "validate_hf_folder",
    "verify_digests",
    "write_digests",
]

"""Checkpoints: HF safetensors weights, DCP optimizer state, an atomic commit across ranks.

    api.py          save_checkpoint / load_checkpoint / finalize_async_save and everything
                    they use (split into layout, I/O, DCP and commit modules next)

The names below are the package's public surface (docs/checkpoints.md).
"""

from policyworker.shell.checkpoint.api import (
    COMMIT_RECORD_PREFIX,
    FINALIZE_TIMEOUT_S,
    INDEX_FILE,
    MANIFEST_FILE,
    MAX_FILE_BYTES,
    MODEL_DIR,
    OPTIM_DIR,
    REFERENCE_DIR,
    AsyncSaver,
    CheckpointError,
    HFTensor,
    detect_weights_format,
    finalize_async_save,
    hf_layout,
    load_checkpoint,
    load_checkpoint_at_init,
    load_hf_weights,
    load_optimizer,
    plan_safetensors_files,
    recover_checkpoint_commits,
    save_checkpoint,
    save_hf_weights,
    save_optimizer,
    validate_hf_folder,
)

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
    "HFTensor",
    "detect_weights_format",
    "finalize_async_save",
    "hf_layout",
    "load_checkpoint",
    "load_checkpoint_at_init",
    "load_hf_weights",
    "load_optimizer",
    "plan_safetensors_files",
    "recover_checkpoint_commits",
    "save_checkpoint",
    "save_hf_weights",
    "save_optimizer",
    "validate_hf_folder",
]

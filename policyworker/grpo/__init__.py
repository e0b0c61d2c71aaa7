"""`policyworker grpo --config run.yaml`: a whole GRPO run from one file, built from the
library's public pieces (PolicyWorker, ClippedPGLossFn, the ZMQ refit into the HF inference
process, async checkpoints).

    run = load_run_config("run.yaml", ["grpo.max_num_steps=3"])  # every problem listed
    summary = run_grpo(run)  # resumes from the latest committed checkpoint

The package, by responsibility: `config` (the run file's sections), `loading` (file ->
checked `RunConfig`), `data` (prompts and tokenizer), `rollout` (the `hf` generation backend),
`checkpoints` (cadence, commit, keep-top-k, resume), `logger` (stdout, JSONL, TensorBoard),
`loop` (the controller). The pure parts live in `policyworker.functional.grpo`.
"""

from policyworker.grpo.config import RunConfig
from policyworker.grpo.loading import load_run_config
from policyworker.grpo.loop import run_grpo

__all__ = ["RunConfig", "load_run_config", "run_grpo"]

"""Where a run's numbers go: one progress line per step on stdout, one JSON object per step in
`log_dir/metrics.jsonl`, TensorBoard scalars and a wandb run when enabled (both as
`train/<metric>` at the step, NeMo-RL's names), and the summary at the end.

A resumed run keeps the JSONL lines of the steps it resumes after and drops later ones (a
killed run may have logged steps whose checkpoint never committed)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any, TextIO

from policyworker.grpo.config import LoggerSection

__all__ = ["RunLogger", "step_line", "summary_lines"]


def step_line(step: int, total: int, m: Mapping[str, float]) -> str:
    return (
        f"step {step}/{total}  reward {m['reward_mean']:.4f}  kl {m['kl']:.5f}  "
        f"loss {m['loss']:.5f}  tok/s {m['tokens_per_s']:.1f}  refit {m['refit_ms']:.1f} ms  "
        f"step {m['step_s']:.2f} s"
    )


def summary_lines(summary: Mapping[str, float], *, resumed_from: int) -> list[str]:
    if not summary:
        return ["grpo: no step to run (max_num_steps reached by the checkpoint)"]
    head = f" (resumed after step {resumed_from})" if resumed_from else ""
    return [
        f"grpo: {int(summary['steps'])} steps in {summary['total_s']:.1f} s{head}; reward "
        f"{summary['reward_first']:.4f} -> {summary['reward_last']:.4f} (best "
        f"{summary['reward_best']:.4f}); {summary['step_s_mean']:.2f} s/step, "
        f"{summary['tokens_per_s_mean']:.1f} tok/s"
    ]


def _start_wandb(
    section: LoggerSection, folder: pathlib.Path, hyperparams: Mapping[str, Any]
) -> Any:
    """A wandb run under `folder/wandb`, as NeMo-RL starts one (`wandb.init(**logger.wandb,
    dir=...)`); its mode (online, offline) is wandb's own setting (`WANDB_MODE`)."""
    import wandb

    w = section.wandb
    (folder / "wandb").mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=w.project,
        name=w.name,
        entity=w.entity,
        group=w.group,
        dir=str(folder / "wandb"),
        config=dict(hyperparams),
    )


class RunLogger:
    def __init__(
        self,
        section: LoggerSection,
        *,
        out: TextIO,
        resume_step: int,
        hyperparams: Mapping[str, Any] | None = None,
    ) -> None:
        self.out = out
        folder = pathlib.Path(section.log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        kept = []
        if resume_step and self.path.is_file():
            for line in self.path.read_text().splitlines():
                if line.strip() and json.loads(line).get("step", 0) <= resume_step:
                    kept.append(line + "\n")
        self.path.write_text("".join(kept))
        self.writer: Any = None
        if section.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(folder / "tensorboard"))
        self.wandb_run: Any = None
        if section.wandb_enabled:
            self.wandb_run = _start_wandb(section, folder, hyperparams or {})

    def step(self, step: int, total: int, metrics: Mapping[str, float]) -> None:
        self.out.write(step_line(step, total, metrics) + "\n")
        self.out.flush()
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}, sort_keys=True) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(f"train/{key}", value, step)
        if self.wandb_run is not None:
            self.wandb_run.log({f"train/{k}": v for k, v in metrics.items()}, step=step)

    def summary(self, summary: Mapping[str, float], *, resumed_from: int) -> None:
        for line in summary_lines(summary, resumed_from=resumed_from):
            self.out.write(line + "\n")
        self.out.flush()
        if self.wandb_run is not None:
            self.wandb_run.summary.update({f"summary/{k}": v for k, v in summary.items()})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()

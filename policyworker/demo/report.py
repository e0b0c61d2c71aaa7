"""What the demo prints: the per-step line, a progress bar, the reward sparkline, an optional PNG.

`step_line`, `final_line` and `sparkline` are pure; `StartupLog` prints one `start:` line per
finished start-up stage (the seconds before step 1 are otherwise silent); `ProgressBar` draws on
a terminal only (nothing when its stream is not a tty, so logs hold only the step lines);
`save_plot` needs matplotlib and says so when it is missing.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import TextIO

__all__ = [
    "ProgressBar",
    "StartupLog",
    "final_line",
    "format_dlogp",
    "save_plot",
    "sparkline",
    "step_line",
]

_BLOCKS = "▁▂▃▄▅▆▇█"


class StartupLog:
    """`start: <stage> (<seconds since the run began> s)` lines; silent when `enabled` is False
    (the other ranks of a torchrun demo)."""

    def __init__(self, stream: TextIO, *, enabled: bool = True) -> None:
        self._stream = stream
        self._enabled = enabled
        self._t0 = time.perf_counter()

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self._t0

    def done(self, stage: str) -> None:
        if self._enabled:
            self._stream.write(f"start: {stage} ({self.elapsed_s:.1f} s)\n")
            self._stream.flush()


def format_dlogp(value: float) -> str:
    """`0.0` for exact parity, else 3 significant digits (`1.19e-07`)."""
    return "0.0" if value == 0.0 else f"{value:.3g}"


def step_line(
    step: int,
    *,
    reward: float,
    kl: float,
    refit_ms: float,
    max_dlogp: float,
    mult_prob_error: float | None = None,
) -> str:
    """`step=<n> reward=<float> kl=<float> refit_ms=<float> max_dlogp=<float>` (as in the README),
    then ` token_mult_prob_error=<float>` when given (the vLLM engine's mismatch metric)."""
    line = (
        f"step={step} reward={reward:.4f} kl={kl:.5f} refit_ms={refit_ms:.1f} "
        f"max_dlogp={format_dlogp(max_dlogp)}"
    )
    if mult_prob_error is not None:
        line += f" token_mult_prob_error={mult_prob_error:.8f}"
    return line


def final_line(first: float, last: float) -> str:
    """`reward: <first> -> <last>` (smoothed ends of the reward curve)."""
    return f"reward: {first:.4f} -> {last:.4f}"


def sparkline(values: Sequence[float], *, lo: float = 0.0, hi: float = 1.0) -> str:
    """One block character per value, scaled from `lo` (lowest block) to `hi` (full block).

    Raises:
        ValueError: `hi <= lo`.
    """
    if not hi > lo:
        msg = f"sparkline range hi={hi} must be > lo={lo}"
        raise ValueError(msg)
    chars = []
    for v in values:
        if math.isnan(v):
            chars.append(" ")
            continue
        frac = min(max((v - lo) / (hi - lo), 0.0), 1.0)
        chars.append(_BLOCKS[min(int(frac * len(_BLOCKS)), len(_BLOCKS) - 1)])
    return "".join(chars)


class ProgressBar:
    """`[#####.....] 5/10 reward 0.41` redrawn in place on a tty; silent otherwise."""

    def __init__(self, total: int, *, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        filled = int(self.width * min(done, self.total) / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {done}/{self.total} {note}\x1b[K")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the bar so the next stdout line starts clean."""
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def save_plot(path: str, rewards: Sequence[float], kls: Sequence[float]) -> bool:
    """Write a PNG of the reward (and KL) curves; False when matplotlib is not installed.

    One legend names both curves (they share the step axis, each with its own y axis); steps
    are whole numbers, so the x ticks are too.
    """
    # matplotlib is the optional `plot` extra, absent from the lint environment.
    try:
        import matplotlib  # pyright: ignore[reportMissingImports]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports]
        from matplotlib.ticker import MaxNLocator  # pyright: ignore[reportMissingImports]
    except ImportError:
        return False
    steps = list(range(1, len(rewards) + 1))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    (reward_line,) = ax.plot(steps, rewards, marker="o", label="reward (mean per step)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2 = ax.twinx()
    (kl_line,) = ax2.plot(steps, kls, color="tab:red", alpha=0.6, label="kl to reference")
    ax2.set_ylabel("kl")
    ax.legend(handles=[reward_line, kl_line], loc="center right")
    ax.set_title("policyworker demo: GRPO on the target-token task")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

"""What a user watches: a progress bar on the terminal and per-step metrics in W&B (offline by default).

`RunMonitor.log(step, metrics)` records one row (in `history`, and its `time.monotonic()` in `logged_at`);
`close()` finishes the W&B run and returns the one-line summary the CLI prints; the reward in both is
`policy_reward(metrics)`. W&B files live under the run directory; every start of a run directory logs into the same
W&B run (its id is kept in RUN_DIR/wandb_run_id), so a resumed job continues its curves.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from streamrl.config import Config


def policy_reward(metrics: dict[str, Any]) -> float:
    """A step's reward as the policy earned it: with dynamic sampling the trained groups leave out solved prompts,
    so the figure with the dropped constant groups (`rollout/reward_mean_unfiltered`) when there is one."""
    return float(metrics.get("rollout/reward_mean_unfiltered", metrics.get("rollout/reward_mean", 0.0)))


def run_id(run_dir: Path) -> str:
    """The W&B run id of a run directory, made at its first start and kept in RUN_DIR/wandb_run_id, so a resumed
    job logs into the same W&B run."""
    path = run_dir / "wandb_run_id"
    if path.is_file() and (existing := path.read_text().strip()):
        return existing
    path.write_text(new := secrets.token_hex(4))
    return new


class RunMonitor:
    def __init__(self, config: Config, show_progress: bool = True, first_step: int = 0):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.steps = config.train.steps
        self.run = wandb.init(
            project=config.wandb.project,
            name=config.run.name,
            id=run_id(config.run.dir),
            resume="allow",
            mode=config.wandb.mode,
            dir=str(config.run.dir.resolve()),
            config=config.model_dump(mode="json"),
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.bar = tqdm(
            total=self.steps,
            initial=first_step,
            desc="train",
            unit="step",
            disable=not show_progress,
            dynamic_ncols=True,
        )
        self.history: list[dict[str, float]] = []
        self.logged_at: list[float] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not metrics.get("train/replayed"):  # a step re-trained from the journal was logged before the crash
            self.run.log(metrics, step=step)
        self.history.append(metrics)
        self.logged_at.append(time.monotonic())
        self.bar.update(1)
        self.bar.set_postfix(
            reward=f"{policy_reward(metrics):.3f}",
            lag=f"{metrics.get('queue/policy_lag_mean', 0.0):.1f}",
            tok_s=f"{metrics.get('perf/tokens_per_s', 0.0):.0f}",
            queue=int(metrics.get("queue/depth", 0)),
        )

    def close(self) -> str:
        self.bar.close()
        self.run.finish()
        if not self.history:
            return "streamrl: no steps completed"
        quarter = max(1, len(self.history) // 4)
        first = sum(policy_reward(h) for h in self.history[:quarter]) / quarter
        last = sum(policy_reward(h) for h in self.history[-quarter:]) / quarter
        total_s = sum(h["perf/step_time_s"] for h in self.history)
        return (
            f"streamrl: {len(self.history)} steps in {total_s:.1f}s | reward {first:.3f} -> {last:.3f} "
            f"(first/last quarter) | final loss {self.history[-1]['train/loss']:.4f}"
        )

"""Staleness ablation on CPU: how each off-policy correction learns when engines sample from old policies.

    python benchmarks/staleness_ablation.py [--lags 0 2 4 8] [--steps 120] [--mini-batches 4] [--out FILE.json]

For every forced lag k and loss variant it runs the tiny job (configs/tiny.yaml, same seed, same
initial model) with `train.publish_lag=k`: the learner publishes the weights of k steps ago, so the
engines sample from policies at least k versions old (the asynchronous pipeline adds its own ~2).
`queue.max_staleness` is raised to k + 8 so that no group is dropped and every variant sees the same
data age. Each step takes `loss.mini_batches` updates, so the PPO clip binds. Variants: `ppo_behaviour`
(plain PPO on the behaviour log-probs, no correction), `tis` (truncated IS), `mis` (AReaL's decoupled PPO
with its cap), `decoupled` (uncapped), `cispo` (truncated IS with the CISPO surrogate), `gspo` (truncated
IS with GSPO's sequence ratio). The on-policy reference is `train.mode=sync` (every group sampled with the
weights its step starts from) with `tis`. Reported: mean reward of the last 20% of steps (after a fixed
number of consumed samples: steps x groups_per_step x n) and the mean measured lag.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

CONFIG = Path(__file__).parents[1] / "configs" / "tiny.yaml"
# name -> (loss.policy_loss, loss.surrogate)
VARIANTS = {
    "ppo_behaviour": ("ppo_behaviour", "ppo"),
    "tis": ("tis", "ppo"),
    "mis": ("mis", "ppo"),
    "decoupled": ("decoupled", "ppo"),
    "cispo": ("tis", "cispo"),
    "gspo": ("tis", "gspo"),
}
SYNC = -1  # the `lag` of the on-policy reference run


def run_one(lag: int, variant: str, steps: int, mini_batches: int, workdir: Path) -> dict[str, float]:
    from streamrl.config import load_config
    from streamrl.orchestrate.driver import train

    config = load_config(
        CONFIG,
        [
            f"run.dir={workdir / f'lag{lag}-{variant}'}",
            f"model.path={workdir / 'model'}",
            f"train.steps={steps}",
            f"loss.policy_loss={VARIANTS[variant][0]}",
            f"loss.surrogate={VARIANTS[variant][1]}",
            f"loss.mini_batches={mini_batches}",
            "wandb.mode=disabled",
            *(["train.mode=sync"] if lag == SYNC else [f"train.publish_lag={lag}", f"queue.max_staleness={lag + 8}"]),
        ],
    )
    start = time.perf_counter()
    history = train(config, show_progress=False).history
    rewards = np.array([row["rollout/reward_mean"] for row in history])
    tail = max(1, len(rewards) // 5)
    return {
        "lag": lag,
        "variant": variant,
        "final_reward": float(rewards[-tail:].mean()),
        "mean_reward": float(rewards.mean()),
        "measured_lag": float(np.mean([row["queue/policy_lag_mean"] for row in history])),
        "dropped_stale": float(history[-1]["queue/dropped_stale"]),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 2, 4, 8])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--no-sync", action="store_true", help="skip the on-policy (sync mode) reference run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/staleness_ablation.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="streamrl-ablation-") as tmp:
        runs = ([] if args.no_sync else [(SYNC, "tis")]) + [(lag, v) for lag in args.lags for v in args.variants]
        for lag, variant in runs:
            rows.append(run_one(lag, variant, args.steps, args.mini_batches, Path(tmp)))
            print(f"lag {lag} {variant}: {rows[-1]}", flush=True)
    print(f"\nreward over the last 20% of {args.steps} steps (mean measured lag in brackets)")
    if not args.no_sync:
        sync = rows[0]
        print(f"on-policy reference (sync mode, tis): {sync['final_reward']:.3f} [{sync['measured_lag']:.1f}]")
    print(f"{'forced lag':>10}" + "".join(f"{v:>22}" for v in args.variants))
    for lag in args.lags:
        cells = [next(r for r in rows if r["lag"] == lag and r["variant"] == v) for v in args.variants]
        print(f"{lag:>10}" + "".join(f"{c['final_reward']:>15.3f} [{c['measured_lag']:4.1f}]" for c in cells))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"steps": args.steps, "mini_batches": args.mini_batches, "rows": rows}
    args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

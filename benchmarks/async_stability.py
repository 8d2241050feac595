"""Async stability on CPU: does asynchronous training keep what it learnt, as the synchronous loop does?

    python benchmarks/async_stability.py [--seeds 0 1 2] [--steps 200] [--variant NAME=KEY=VALUE,KEY=VALUE ...]
        [--out FILE.json] [override ...]

Runs the tiny job (configs/tiny.yaml) on the long-tail symbols task (one prompt in 8 asks for 8x the symbols,
responses up to 96 tokens, `queue.max_staleness` 2) for `--steps` steps, once per seed and variant; a variant is a
name and the overrides that make it (default: `sync` = `train.mode=sync`, `async` = the defaults, `async-mis` =
`loss.policy_loss=mis`). The task is learnt in about 100 steps, so the second half shows whether a run keeps it.
Reported per run, over the steps after the first half: the mean and lowest reward, the steps whose reward fell
under 0.9, and the largest `train/behaviour_kl` (how far the learner had moved from the weights that sampled a
step: the spike that comes with a collapse); and per variant the mean over its seeds. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).parents[1] / "configs" / "tiny.yaml"
TASK = ["task.long_fraction=0.125", "rollout.max_tokens=96", "queue.max_staleness=2", "queue.max_backlog=24"]
DEFAULT_VARIANTS = ["sync=train.mode=sync", "async=", "async-mis=loss.policy_loss=mis"]


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME=KEY=VALUE,KEY=VALUE` (or `NAME=` for the defaults) -> (name, overrides)."""
    name, sep, rest = text.partition("=")
    if not name or not sep:
        raise argparse.ArgumentTypeError(f"--variant: expected NAME=KEY=VALUE,..., got {text!r}")
    return name, [item for item in rest.split(",") if item]


def run_one(seed: int, overrides: list[str], steps: int, workdir: Path) -> dict[str, Any]:
    from streamrl.config import load_config
    from streamrl.monitor import policy_reward
    from streamrl.orchestrate.driver import train

    config = load_config(
        CONFIG,
        [
            f"run.dir={workdir}",
            f"model.path={workdir.parent / 'model'}",
            f"run.seed={seed}",
            f"train.steps={steps}",
            "train.checkpoint_every=0",
            "wandb.mode=disabled",
            *TASK,
            *overrides,
        ],
    )
    start = time.perf_counter()
    history = train(config, show_progress=False).history
    late = history[len(history) // 2 :]
    rewards = [policy_reward(row) for row in late]
    return {
        "seed": seed,
        "late_reward_mean": statistics.fmean(rewards),
        "late_reward_min": min(rewards),
        "late_steps_below_0_9": sum(reward < 0.9 for reward in rewards),
        "late_behaviour_kl_max": max(row.get("train/behaviour_kl", 0.0) for row in late),
        "policy_lag_mean": statistics.fmean(row["queue/policy_lag_mean"] for row in history),
        "rewards": [policy_reward(row) for row in history],
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variant", type=parse_variant, action="append", dest="variants")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/async_stability.json"))
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for every run")
    args = parser.parse_args()
    variants = args.variants or [parse_variant(v) for v in DEFAULT_VARIANTS]
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="streamrl-stability-") as tmp:
        for name, overrides in variants:
            for seed in args.seeds:
                row = run_one(seed, [*args.overrides, *overrides], args.steps, Path(tmp) / f"{name}-{seed}")
                results.setdefault(name, []).append(row)
                print(f"{name} seed {seed}: { {k: v for k, v in row.items() if k != 'rewards'} }", flush=True)
    print(f"\nsteps {args.steps // 2 + 1}-{args.steps}, per seed: reward mean / min (steps < 0.9) [max behaviour KL]")
    for name, rows in results.items():
        cells = "  ".join(
            f"{r['late_reward_mean']:.3f}/{r['late_reward_min']:.3f} ({r['late_steps_below_0_9']}) "
            f"[{r['late_behaviour_kl_max']:.2f}]"
            for r in rows
        )
        print(f"{name:>12}: mean {statistics.fmean(r['late_reward_mean'] for r in rows):.3f} | {cells}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"steps": args.steps, "task": TASK, "overrides": args.overrides, "variants": dict(variants)}
    args.out.write_text(json.dumps({**summary, "runs": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

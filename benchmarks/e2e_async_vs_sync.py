"""End to end: asynchronous streaming against the synchronous loop, the same program on the same GPUs.

Usage: `python benchmarks/e2e_async_vs_sync.py -c CONFIG [--steps 30] [--staleness 1 2 4] [--colocated]
[--warmup-steps 2] [--only ARRANGEMENT ...] [--out PATH] [override ...]`. For each arrangement — `train.mode=sync`;
with `--colocated` also the colocated synchronous one (the same GPUs, every one shared by a learner rank and an
engine: learner data-parallel and engines scaled up to all of them, engines asleep while the learner trains); then
async at each `queue.max_staleness` — it starts the job (engines, learner, Redis), then times `--steps` steps from the
first step on (start-up excluded), sampling every GPU's utilisation with nvidia-smi every 0.5 s, and reports: how it
splits the GPUs (engines x GPUs each + learner ranks), generated and trained tokens/s and the step time split in the
steady state (the steps after `--warmup-steps`, whose first compiles the learner's kernels, over their own iterations'
wall time), the whole run's wall time and its first step's, the GPU busy fraction of the engines' and the learner's
GPUs (in the steady state, between the end of the last warm-up step and the end of the last step, as the rates; and
over the whole run), policy lag, publish time,
stale drops, the reward per consumed sample (every step consumes the same number of samples) and the reward at
equal versions (of the samples that the same policy versions generated: the last quarter of the versions every
arrangement reached; a step's version is the learner's before it less the step's mean lag). `--only sync
colocated async-2 ...` runs a subset (a long comparison split over several invocations, whose JSON files
`--merge A.json B.json ... --out PATH` joins into one table, the reward at equal versions taken over all of them).
The async backlog is
`staleness + 1` steps of groups, everything the staleness gate lets into the system (the gate, not the backlog,
keeps the lag of consumed groups within the bound; a smaller backlog would keep finished groups out of the stream
while the learner waits for them); sync holds one step. Each arrangement starts from an empty
`run.dir/<mode>-<staleness>`. On random weights a response's length follows the model's end-of-sequence probability,
not the task: `task.exact_lengths=true` gives each response its prompt's target in tokens (the long prompts
`task.long_factor` times longer), the long tail for which a synchronous step waits on its longest responses.

Prints a table and writes `benchmarks/results/e2e_async_vs_sync.json` (or `--out`). On CPU (no nvidia-smi) the GPU
columns stay empty.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from gpu_sampler import GpuSampler

from streamrl.config import Config, load_config
from streamrl.monitor import policy_reward
from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run, run_steps


def arrangement(base: Config, mode: str, staleness: int) -> Config:
    """The base config in `mode` ("sync", "colocated" or "async") at `staleness`, on the base's GPUs."""
    backlog = base.batching.groups_per_step * (staleness + 1 if mode == "async" else 1)
    overrides: dict[str, dict[str, Any]] = {
        "train": {"mode": "async" if mode == "async" else "sync", "checkpoint_every": 0},
        "queue": {"max_staleness": staleness, "max_backlog": backlog},
        "run": {"dir": str(base.run.dir / f"{mode}-{staleness}"), "name": f"{base.run.name}-{mode}-{staleness}"},
    }
    if mode == "colocated":  # every GPU runs a learner rank and (a part of) an engine
        learner, rollout = base.learner, base.rollout
        gpus = learner.world_size + rollout.engines * rollout.gpus_per_engine
        overrides["learner"] = {"data_parallel": gpus // (learner.world_size // learner.data_parallel)}
        overrides["rollout"] = {"engines": gpus // rollout.gpus_per_engine}
        overrides["cluster"] = {"gpus": gpus}
    tree = base.model_dump(mode="json")
    for section, values in overrides.items():
        tree[section].update(values)
    return Config.model_validate(tree)


def gpu_split(config: Config) -> str:
    """How an arrangement uses its GPUs: "engines x GPUs each + learner ranks", "shared" when colocated."""
    rollout = config.rollout
    split = f"{rollout.engines}x{rollout.gpus_per_engine} + {config.learner.world_size}"
    return f"{split} shared" if config.colocated else split


def measure(config: Config, mode: str, warmup: int) -> dict[str, Any]:
    # A fresh run directory: an earlier invocation's journal there, with no checkpoint, would be resumed, and its
    # steps re-trained from the journal instead of generated (and its Redis would hold its queue and versions).
    shutil.rmtree(config.run.dir, ignore_errors=True)
    prepare_run(config)
    sampler = GpuSampler()
    with Cluster(config) as cluster:
        placement = json.loads((config.run.dir / "placement.json").read_text())
        sampler.start()
        start = time.monotonic()
        result = run_steps(cluster, config, show_progress=False)
        wall_s = time.monotonic() - start
        sampler.stop()
    history = result.history
    if len(history) <= warmup:
        raise ValueError(f"--warmup-steps {warmup}: the run made only {len(history)} steps")
    # Steady state: the steps after the warm-up ones (whose first step compiles the learner's kernels), over the
    # wall time of their own iterations.
    steady = history[warmup:]
    steady_s = sum(row["perf/iteration_s"] for row in steady)
    # The GPUs' steady window: the warm-up steps (kernel compilation, cold caches) leave the GPUs mostly idle, and
    # took a third of the long-tail runs' time, which the whole run's busy fraction counted.
    window = (result.step_ends[warmup - 1] if warmup else start, result.step_ends[-1])
    engine_gpus = [g for e in placement["engines"] for g in e["gpus"]]
    learner_gpus = [g for r in placement["learners"] for g in r["gpus"]]
    before = history[warmup - 1]["rollout/tokens_generated"] if warmup else 0.0

    def trained(rows: list[dict[str, Any]]) -> float:
        return sum(row["perf/tokens_per_s"] * row["perf/step_time_s"] for row in rows)

    def mean(key: str) -> float:
        return statistics.fmean(row.get(key, 0.0) for row in steady)

    rewards = [policy_reward(row) for row in history]
    # The policy version that generated each step's samples (on average over its groups): the learner's version
    # before the step less the step's mean lag.
    versions = [row["train/policy_version"] - 1 - row["queue/policy_lag_mean"] for row in history]
    quarter = max(1, len(rewards) // 4)
    return {
        "mode": mode,
        "gpus": gpu_split(config),
        "max_staleness": config.queue.max_staleness,
        "max_backlog": config.queue.max_backlog,
        "steps": len(history),
        "warmup_steps": warmup,
        "wall_s": wall_s,
        "generated_tokens_per_s": history[-1]["rollout/tokens_generated"] / wall_s,
        "trained_tokens_per_s": trained(history) / wall_s,
        "steady_s": steady_s,
        "steady_generated_tokens_per_s": (history[-1]["rollout/tokens_generated"] - before) / steady_s,
        "steady_trained_tokens_per_s": trained(steady) / steady_s,
        "engine_gpu_busy": sampler.busy(engine_gpus),  # the whole run, warm-up steps included
        "learner_gpu_busy": sampler.busy(learner_gpus),
        "engine_gpu_busy_steady": sampler.busy(engine_gpus, *window),
        "learner_gpu_busy_steady": sampler.busy(learner_gpus, *window),
        "learner_compute_fraction": sum(
            row["perf/forward_backward_s"] + row["perf/optimizer_s"] + row.get("perf/grad_reduce_s", 0.0)
            for row in steady
        )
        / steady_s,
        "policy_lag_mean": mean("queue/policy_lag_mean"),
        "response_length_mean": mean("rollout/response_length_mean"),
        "response_length_max": mean("rollout/response_length_max"),  # a step's longest response, on average
        "dropped_stale": history[-1]["queue/dropped_stale"],
        "first_step_s": history[0]["perf/iteration_s"],
        "step_s": mean("perf/step_time_s"),
        "wait_s": mean("queue/wait_s"),
        "forward_backward_s": mean("perf/forward_backward_s"),
        "optimizer_s": mean("perf/optimizer_s"),
        "publish_s": mean("perf/publish_s"),
        "generate_wait_s": mean("perf/generate_wait_s"),  # sync: the engines' turn, before the learner's step
        "engine_sleep_s": mean("perf/engine_sleep_s"),  # colocated: the engines freeing their GPUs
        "engine_wake_s": mean("perf/engine_wake_s"),
        # Learner allocations retried after emptying the allocator's cache: a step slowed by memory pressure.
        "alloc_retries": mean("perf/alloc_retries"),
        "reward_per_sample": statistics.fmean(rewards),
        "reward_last_quarter": statistics.fmean(rewards[-quarter:]),
        # Adam's eps compares with a parameter's gradient, so a late-phase norm over sqrt(parameters) sizes it.
        "grad_norm_last_quarter": statistics.fmean(row["train/grad_norm"] for row in history[-quarter:]),
        "reward_by_version": [[v, r] for v, r in zip(versions, rewards, strict=True)],
        "placement": placement,
    }


def _reward_at_equal_versions(runs: list[dict[str, Any]]) -> None:
    """Each run's mean reward of the samples that the same policy versions generated: the last quarter of the
    versions every run reached. Reward per consumed sample charges an asynchronous run for its lag (its samples come
    from versions a few updates old); at equal versions it compares what the same number of updates learnt."""
    highest = min(max(v for v, _ in r["reward_by_version"]) for r in runs)
    quarter = max(1, min(r["steps"] for r in runs) // 4)
    for r in runs:
        window = [reward for v, reward in r["reward_by_version"] if highest - quarter < v <= highest]
        r["reward_versions"] = [highest - quarter, highest]
        r["reward_at_equal_versions"] = statistics.fmean(window) if window else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--colocated", action="store_true", help="also the colocated synchronous arrangement")
    parser.add_argument(
        "--warmup-steps", type=int, default=2, help="steps left out of the steady-state figures (compilation)"
    )
    parser.add_argument(
        "--only", nargs="+", help="run only these arrangements (sync, colocated, async-S): a run split over calls"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/e2e_async_vs_sync.json"))
    parser.add_argument("--merge", type=Path, nargs="+", help="join these runs' JSON files into one table (no run)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    if args.config is None:
        parser.error("-c/--config is required (unless --merge)")
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps: {args.warmup_steps} must be in [0, --steps)")
    for name in args.only or []:
        # `--only` takes every word after it: overrides written after it would silently become arrangements.
        if not re.fullmatch(r"sync|colocated|async-\d+", name):
            parser.error(
                f"--only: {name!r} is not an arrangement (sync, colocated, async-S); overrides go before --only"
            )
    base = load_config(args.config, [*args.overrides, f"train.steps={args.steps}"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []

    def save() -> None:
        args.out.write_text(
            json.dumps({"config": str(args.config), "overrides": args.overrides, "runs": runs}, indent=1)
        )

    # Each arrangement is reported and saved as it ends, so a run cut short keeps what it measured (and its logs
    # under run.dir/<mode>-<staleness>/logs say where it stopped).
    synchronous = [("sync", 1)] + ([("colocated", 1)] if args.colocated else [])
    for mode, staleness in synchronous + [("async", s) for s in args.staleness]:
        if args.only and (mode if mode != "async" else f"async-{staleness}") not in args.only:
            continue
        print(f"{mode}, max_staleness {staleness}: running {args.steps} steps", flush=True)
        runs.append(measure(arrangement(base, mode, staleness), mode, args.warmup_steps))
        print({k: v for k, v in runs[-1].items() if k != "placement"}, flush=True)
        save()
    _reward_at_equal_versions(runs)
    save()
    print_table(runs)
    print(f"wrote {args.out}")


def merge(paths: list[Path], out: Path) -> None:
    """The arrangements of several invocations as one comparison: their runs (each tagged with its file's
    overrides), the reward at equal versions over all of them, one table."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        part = json.loads(path.read_text())
        runs += [{**run, "config": part["config"], "overrides": part["overrides"]} for run in part["runs"]]
    _reward_at_equal_versions(runs)
    out.write_text(json.dumps({"merged": [str(p) for p in paths], "runs": runs}, indent=1))
    print_table(runs)
    print(f"wrote {out}")


def print_table(runs: list[dict[str, Any]]) -> None:
    """Steady state, against the faster synchronous arrangement (when the runs have one)."""
    synced = [r["steady_trained_tokens_per_s"] for r in runs if r["mode"] != "async"]
    sync = max(synced) if synced else None
    print(
        "| mode | GPUs (engines + learner) | staleness | wall s | first step s | gen tok/s | trained tok/s | "
        "vs best sync | engine GPU busy steady / run | learner GPU busy steady / run | lag | drops | "
        "response len mean / max | sync gen wait s | step s | wait s | fwd+bwd s | alloc retries | publish s | "
        "reward/sample | reward at equal versions |"
    )
    print("|" + "---|" * 21)
    for r in runs:
        # Runs measured before the steady window was sampled have the whole run's busy fraction only.
        busy = [
            " / ".join(
                "-" if r.get(k) is None else f"{r[k]:.2f}" for k in (f"{side}_gpu_busy_steady", f"{side}_gpu_busy")
            )
            for side in ("engine", "learner")
        ]
        lengths = "-"  # runs measured before the lengths were reported have none
        if "response_length_max" in r:
            lengths = f"{r['response_length_mean']:.0f} / {r['response_length_max']:.0f}"
        ratio = "-" if sync is None else f"{r['steady_trained_tokens_per_s'] / sync:.2f}"
        retries = "-" if "alloc_retries" not in r else f"{r['alloc_retries']:.1f}"  # older runs did not count them
        print(
            f"| {r['mode']} | {r.get('gpus', '-')} | {r['max_staleness']} | {r['wall_s']:.1f} | "
            f"{r['first_step_s']:.1f} | "
            f"{r['steady_generated_tokens_per_s']:.0f} | {r['steady_trained_tokens_per_s']:.0f} | {ratio} | "
            f"{busy[0]} | {busy[1]} | {r['policy_lag_mean']:.2f} | {r['dropped_stale']:.0f} | {lengths} | "
            f"{r['generate_wait_s']:.3f} | {r['step_s']:.3f} | {r['wait_s']:.3f} | "
            f"{r['forward_backward_s']:.3f} | {retries} | {r['publish_s']:.3f} | {r['reward_per_sample']:.3f} | "
            f"{r['reward_at_equal_versions']:.3f} |"
        )


if __name__ == "__main__":
    main()

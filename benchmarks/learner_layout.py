"""A preset's learner at one of its layouts on this machine's GPUs, next to what `streamrl plan` predicts for it.

Run on a GPU machine with as many GPUs as the layout's learner (megatron-core importable):
    PYTHONPATH=. python benchmarks/learner_layout.py -c configs/qwen3-30b-a3b.yaml cluster.gpus=4

It starts one process per learner rank, builds the production trainer (`streamrl.learner.trainer.Trainer`: the model
in the preset's real shape with random weights, Megatron's DDP and distributed optimizer with the preset's offload,
recomputation and layout), plans a step of RL-like trajectory groups (the preset's `batching.groups_per_step` groups
of `rollout.n` unless `--groups`/`--n`; `benchmarks/learner_mfu.py`'s lognormal response lengths) with the production
planner into packed micro-batches per data-parallel rank, and times `--steps` steps after one warm-up step
(`--profile`: then one more, rank 0's GPU kernels under torch.profiler, written beside the JSON as `.profile.txt`).
The steps train the same groups, unless `--vary`: new lengths every step, as RL's are (`--exact-shapes` then measures
what a step cost before padded attention shapes were rounded to a few sizes: every new shape is a cuDNN graph built).
It reports step time, MFU (the trainer's own FLOP count over `learner.peak_tflops`, 989 for H100/H200 bf16), peak GPU
memory (allocated and reserved, the fullest rank), peak host memory (the node's used memory, sampled through the
steps, less what it was before start-up) and the plan's prediction for each, then writes them as JSON. The planner's
layout is the learner's alone: engines are not started.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

GB = 1e9


def _meminfo() -> dict[str, float]:
    """/proc/meminfo's fields (the node's memory) as bytes (read: MemTotal and MemAvailable, both in kB there)."""
    fields = (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {key: int(value.split()[0]) * 1024.0 for key, value in fields}


def _host_used() -> float:
    """Bytes of the node's memory in use (MemTotal - MemAvailable), read once per sample."""
    memory = _meminfo()
    return memory["MemTotal"] - memory["MemAvailable"]


def _rank(rank: int, args: argparse.Namespace, port: int, out: Path) -> None:
    began = time.perf_counter()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from benchmarks.learner_mfu import make_groups
    from streamrl.batching.microbatch import plan_step
    from streamrl.config import load_config
    from streamrl.learner.optimizer import host_threads
    from streamrl.learner.parallel import destroy_parallel, init_parallel
    from streamrl.learner.trainer import Trainer
    from streamrl.orchestrate import model_architecture

    config = load_config(args.config, args.overrides)
    hf = model_architecture(config)  # a preset's own, or the checkpoint's (written or to be written)
    os.environ["LOCAL_RANK"] = str(rank)
    # As a learner rank of `streamrl train` does: the node's cores split among the ranks for the offloaded optimizer.
    torch.set_num_threads(host_threads(config.optimizer, config.learner.world_size // config.cluster.nodes))
    init_parallel(config.learner, rank, "127.0.0.1", port, seed=0)
    trainer = Trainer(config, hf, None)
    built_s = time.perf_counter() - began  # process start to a trainer with its model and optimizer: the start-up
    if rank == 0:
        print(f"trainer built in {built_s:.1f} s", flush=True)
    if args.exact_shapes:  # the baseline of the A/B: each bucket's padded attention shape as it comes
        from streamrl.learner.model import attention

        attention.grid_size = lambda n: n  # noqa: E731

    def step_groups(step: int) -> tuple[list, list]:
        groups = make_groups(args, hf["vocab_size"], seed=step if args.vary else 0)
        budget = config.batching.max_tokens_per_microbatch
        per_rank = plan_step(
            groups,
            ps.get_data_parallel_world_size(),
            budget,
            "token_mean",
            equal_tokens=config.learner.moe_dispatcher == "allgather",
        )
        return groups, per_rank[ps.get_data_parallel_rank()]

    groups, microbatches = step_groups(0)
    cuda = torch.cuda.is_available()  # a CPU run (gloo) only checks the script
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    results, tokens = [], []
    for step in range(args.steps + 1):  # the first is the warm-up
        if args.vary and step:
            groups, microbatches = step_groups(step)
        tokens.append(sum(len(g.prompt_ids) * len(g.lengths) + int(sum(g.lengths)) for g in groups))
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        result = trainer.train(microbatches, step, step)
        if cuda:
            torch.cuda.synchronize(device)
        results.append((time.perf_counter() - start, result.metrics))
        if rank == 0:
            phases = ", ".join(f"{k.split('/')[-1]} {v:.2f}" for k, v in result.metrics.items() if k.endswith("_s"))
            # Memory pressure: allocations retried after the caching allocator emptied its cache.
            retries = int(result.metrics.get("perf/alloc_retries", 0))
            label = f"step {step}{' (warm-up)' if not step else ''}"
            print(f"{label}: {results[-1][0]:.2f} s ({phases}), {retries} alloc retries", flush=True)
    reserved = torch.tensor([torch.cuda.max_memory_reserved(device) / GB if cuda else 0.0], device=device)
    dist.all_reduce(reserved, op=dist.ReduceOp.MAX)
    timed = results[1:]
    seconds = float(np.median([s for s, _ in timed]))
    if args.profile:  # one more step, every rank (its collectives need them all), rank 0's under the profiler
        from benchmarks.learner_mfu import profile_step

        extra = lambda: trainer.train(microbatches, args.steps + 1, args.steps + 1)  # noqa: E731
        if rank == 0 and cuda:
            profile_step(extra, seconds, out.with_suffix(".rank0.profile.txt"))
        else:
            extra()
    if rank == 0:
        out.with_suffix(".rank0.json").write_text(
            json.dumps(
                {
                    "startup_s": built_s,
                    "warmup_step_s": results[0][0],
                    # Where the warm-up's extra time goes: compiling and cuDNN graphs (forward/backward) or the
                    # optimizer's state made on first use.
                    "warmup_phases": {k: v for k, v in results[0][1].items() if k.endswith("_s")},
                    "step_seconds": seconds,
                    "steps": [s for s, _ in timed],
                    "alloc_retries": [int(m.get("perf/alloc_retries", 0)) for _, m in timed],
                    "tokens": int(np.median(tokens[1:])),
                    "tokens_per_s": sum(tokens[1:]) / sum(s for s, _ in timed),
                    "vary": args.vary,
                    "exact_shapes": args.exact_shapes,
                    "microbatches_rank0": len(microbatches),
                    "mfu": float(np.median([m.get("perf/mfu", np.nan) for _, m in timed])),  # nan: no peak_tflops
                    "phases": {k: v for k, v in timed[-1][1].items() if k.startswith("perf/")},
                    "peak_allocated_gb": max(m["perf/peak_memory_gib"] for _, m in results) * 2**30 / GB,
                    "peak_reserved_gb": float(reserved),
                }
            )
        )
    destroy_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", required=True, type=Path)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.gpus=4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, help="trajectory groups a step (default: batching.groups_per_step)")
    parser.add_argument("--n", type=int, help="responses per group (default: rollout.n)")
    parser.add_argument("--mean-len", type=int, default=1500)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/learner_layout_<run.name>.json")
    parser.add_argument(
        "--profile", action="store_true", help="one more step with rank 0 under torch.profiler: its top GPU kernels"
    )
    parser.add_argument("--vary", action="store_true", help="new response lengths every step, as RL's")
    parser.add_argument(
        "--exact-shapes", action="store_true", help="padded attention shapes not rounded (the baseline of an A/B)"
    )
    args = parser.parse_args()

    from streamrl.config import load_config
    from streamrl.net import free_port
    from streamrl.orchestrate import model_architecture
    from streamrl.plan import plan_memory
    from streamrl.plan.memory import HOST_USABLE

    config = load_config(args.config, args.overrides)
    args.groups = args.groups or config.batching.groups_per_step  # the preset's own step unless told otherwise
    args.n = args.n or config.rollout.n
    cuda = torch.cuda.is_available()
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / GB if cuda else config.cluster.gpu_memory_gb
    plan = plan_memory(config, model_architecture(config), gpu_gb)
    stage = max(plan.learner, key=lambda s: s.total)  # the fullest learner GPU
    world = config.learner.world_size
    if cuda and torch.cuda.device_count() < world:
        raise SystemExit(f"the layout's learner needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    # The learner's own host memory on this node: its ranks' offloaded optimizer state and loading buffers. On GPUs a
    # run over the plan's usable share is refused before start-up: running out of host memory kills the ranks without
    # a trace. (Not on CPU: the plan's 12 GB a rank is a GPU process's, and a CPU rank's model is small.)
    host_planned = max(s.host for s in plan.learner) * min(world, config.cluster.gpus_per_node or world)
    node_memory = _meminfo()["MemTotal"]
    if cuda and host_planned > HOST_USABLE * node_memory:
        raise SystemExit(
            f"the learner plans {host_planned / GB:.0f} GB of host memory, over {HOST_USABLE:.0%} of this node's "
            f"{node_memory / GB:.0f} GB: lower optimizer.offload_fraction"
        )
    out = args.out or Path(f"benchmarks/results/learner_layout_{config.run.name}_{config.cluster.gpus}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    before, peak_host = _host_used(), [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            peak_host[0] = max(peak_host[0], _host_used() - before)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    # Rank 0's files are named after the JSON: two runs writing beside each other (one per GPU) keep theirs apart.
    mp.spawn(_rank, args=(args, free_port(), out), nprocs=world, join=True)
    stop.set()
    rank0 = out.with_suffix(".rank0.json")
    measured = json.loads(rank0.read_text())
    rank0.unlink()
    result = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": world,
        "config": str(args.config),
        "overrides": args.overrides,
        "layout": config.learner.model_dump(),
        "optimizer": config.optimizer.model_dump(),
        "tokens_per_microbatch": config.batching.max_tokens_per_microbatch,
        "groups": args.groups,
        "responses_per_group": args.n,
        "wall_s": time.perf_counter() - start,
        **measured,
        "peak_host_gb": peak_host[0] / GB,
        "plan": {
            "gpu_gb": stage.total / GB,
            "terms_gb": {k: v / GB for k, v in stage.terms.items()},
            "host_gb": host_planned / GB,
        },
    }
    out.write_text(json.dumps(result, indent=2))
    print(
        f"\n{config.run.name} learner on {world}x {result['gpu']}: TP {config.learner.tensor_parallel} "
        f"PP {config.learner.pipeline_parallel} EP {config.learner.expert_parallel} DP {config.learner.data_parallel}, "
        f"offload {config.optimizer.offload_fraction if config.optimizer.cpu_offload else 0.0}, "
        f"{args.groups} groups of {args.n}, {result['tokens']} tokens a step, built in {result['startup_s']:.0f} s"
    )
    print(f"{'':<28}{'measured':>10}{'plan':>10}")
    print(f"{'step s':<28}{result['step_seconds']:>10.2f}   (steps: {', '.join(f'{s:.2f}' for s in result['steps'])})")
    print(f"{'tokens/s':<28}{result['tokens_per_s']:>10.0f}")
    print(f"{'MFU (989 TFLOP/s)':<28}{result['mfu']:>10.3f}")
    print(f"{'peak GPU GB (reserved)':<28}{result['peak_reserved_gb']:>10.1f}{result['plan']['gpu_gb']:>10.1f}")
    print(f"{'peak GPU GB (allocated)':<28}{result['peak_allocated_gb']:>10.1f}")
    print(f"{'peak host GB (node)':<28}{result['peak_host_gb']:>10.1f}{result['plan']['host_gb']:>10.1f}")
    profiled = out.with_suffix(".rank0.profile.txt")
    if args.profile and profiled.exists():  # rank 0's kernels (NCCL's all-to-all among them), beside the JSON
        profiled.replace(out.with_suffix(".profile.txt"))
        print(out.with_suffix(".profile.txt").read_text())


if __name__ == "__main__":
    main()

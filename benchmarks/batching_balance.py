"""Data-parallel balance of a learner step: streamrl's planner against fixed padded micro-batches and sort-and-stride.

Usage: `python benchmarks/batching_balance.py`. Prints a table and writes `benchmarks/results/batching_balance.json`.

Steps of sequence lengths drawn from two distributions (seeded):
- lognormal: median 1,000 tokens, sigma 0.8, clipped to [16, 32768];
- long-tail reasoning mix: 95% uniform in [200, 2000], 5% uniform in [16384, 32768].
Each step is split over 8, 64 and 512 data-parallel ranks, with a budget of 16,384 tokens per micro-batch, and
cost(L) = a*L + b*L^2 with a, b derived from a Qwen3-8B shape (`streamrl.batching.cost.flops_cost_model`).
Methods:
- fixed+pad: each rank takes an equal contiguous share in arrival order (a distributed sampler); micro-batches of
  a fixed number of sequences (budget // mean length), right-padded to their longest; a rank's cost is the padded
  work it executes, m * cost(longest) per micro-batch.
- stride: sort by length descending and deal sequence i to rank i mod k; packed like ours (no padding).
- LPT: sort descending, each sequence to the currently lightest rank (heapq; reference for quality and time).
- streamrl: `balanced_partition` (KK head, water-filling tail, swaps) + `pack_microbatches`.
Reported per method: max/mean cost over ranks (1.0 is perfect), padding fraction of the processed tokens,
micro-batches per rank (and streamrl's filler micro-batches), planning time (median of 5, index-level plan, no
tensor copies) at 100k sequences per step; balance is also shown for a smaller step of 32 sequences per rank.
"""

from __future__ import annotations

import heapq
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from streamrl.batching.cost import CostModel, flops_cost_model  # noqa: E402
from streamrl.batching.pack import pack_microbatches  # noqa: E402
from streamrl.batching.partition import balanced_partition  # noqa: E402

QWEN3_8B = dict(
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
)
BUDGET = 16_384
RANKS = (8, 64, 512)
STEP_SEQUENCES = 100_000
REPEATS = 5
OUT = Path(__file__).resolve().parent / "results" / "batching_balance.json"


def lognormal(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(1000), 0.8, n), 16, 32768).astype(np.int64)


def reasoning_mix(n: int, rng: np.random.Generator) -> np.ndarray:
    long = rng.random(n) < 0.05
    return np.where(long, rng.integers(16384, 32769, n), rng.integers(200, 2001, n)).astype(np.int64)


def plan_fixed(lengths: np.ndarray, ranks: int, cost: CostModel) -> dict:
    """Equal contiguous shards in arrival order (a distributed sampler drops the remainder), fixed-size batches."""
    per_rank = len(lengths) // ranks
    return dict(shards=np.arange(per_rank * ranks).reshape(ranks, per_rank), size=max(1, BUDGET // int(lengths.mean())))


def plan_stride(lengths: np.ndarray, ranks: int, cost: CostModel) -> dict:
    rank_of = np.empty(len(lengths), dtype=np.int64)
    rank_of[np.argsort(-lengths, kind="stable")] = np.arange(len(lengths)) % ranks
    return dict(rank_of=rank_of, packing=pack_microbatches(lengths, rank_of, ranks, BUDGET))


def plan_lpt(lengths: np.ndarray, ranks: int, cost: CostModel) -> dict:
    costs = cost(lengths)
    heap = [(0.0, rank) for rank in range(ranks)]
    rank_of = np.empty(len(lengths), dtype=np.int64)
    for item in np.argsort(-costs, kind="stable").tolist():
        load, rank = heap[0]
        heapq.heapreplace(heap, (load + costs[item], rank))
        rank_of[item] = rank
    return dict(rank_of=rank_of, packing=pack_microbatches(lengths, rank_of, ranks, BUDGET))


def plan_streamrl(lengths: np.ndarray, ranks: int, cost: CostModel) -> dict:
    rank_of = balanced_partition(lengths, ranks, cost)
    return dict(rank_of=rank_of, packing=pack_microbatches(lengths, rank_of, ranks, BUDGET))


METHODS: dict[str, Callable[[np.ndarray, int, CostModel], dict]] = {
    "fixed+pad": plan_fixed,
    "stride": plan_stride,
    "LPT": plan_lpt,
    "streamrl": plan_streamrl,
}


def evaluate(plan: dict, lengths: np.ndarray, ranks: int, cost: CostModel) -> dict:
    """Per-rank executed cost, padding fraction, micro-batches per rank and filler micro-batches of a plan."""
    if "shards" in plan:  # padded: a micro-batch of m rows costs m * cost(longest row)
        shards, size = lengths[plan["shards"]], plan["size"]
        chunks = [shards[:, i : i + size] for i in range(0, shards.shape[1], size)]
        padded = np.concatenate([np.repeat(c.max(1, keepdims=True), c.shape[1], axis=1) for c in chunks], axis=1)
        return dict(
            loads=cost(padded).sum(1),
            padding=1 - shards.sum() / padded.sum(),
            microbatches=-(-shards.shape[1] // size),
            fillers=0,
        )
    packing = plan["packing"]
    return dict(
        loads=np.bincount(plan["rank_of"], weights=cost(lengths), minlength=ranks),
        padding=0.0,
        microbatches=packing.microbatches_per_rank,
        fillers=int((np.diff(packing.bounds) == 0).sum()),
    )


def plan_ms(
    method: Callable[[np.ndarray, int, CostModel], dict], lengths: np.ndarray, ranks: int, cost: CostModel
) -> float:
    """Median wall time of planning the step (partition + packing, index-level: no tensors are built)."""
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        method(lengths, ranks, cost)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return dict(
        cpu=cpu,
        nproc=nproc,
        python=platform.python_version(),
        numpy=np.__version__,
        date=datetime.now(UTC).strftime("%Y-%m-%d"),
    )


def main() -> None:
    cost = flops_cost_model(QWEN3_8B)
    rows = []
    for dist_name, draw in (("lognormal", lognormal), ("reasoning mix", reasoning_mix)):
        for ranks in RANKS:
            for step in (STEP_SEQUENCES, 32 * ranks):
                lengths = draw(step, np.random.default_rng(ranks))
                for name, method in METHODS.items():
                    result = evaluate(method(lengths, ranks, cost), lengths, ranks, cost)
                    rows.append(
                        dict(
                            distribution=dist_name,
                            ranks=ranks,
                            sequences=step,
                            method=name,
                            max_over_mean=float(result["loads"].max() / result["loads"].mean()),
                            padding=float(result["padding"]),
                            microbatches_per_rank=result["microbatches"],
                            fillers=result["fillers"],
                            plan_ms=plan_ms(method, lengths, ranks, cost) if step == STEP_SEQUENCES else None,
                        )
                    )
    header = (
        f"{'distribution':14} {'ranks':>5} {'seqs':>7} {'method':10} {'max/mean':>9} {'padding':>8} "
        f"{'mb/rank':>8} {'fillers':>7} {'plan ms':>8}"
    )
    print(header)
    for r in rows:
        plan = f"{r['plan_ms']:8.1f}" if r["plan_ms"] is not None else f"{'':8}"
        print(
            f"{r['distribution']:14} {r['ranks']:5d} {r['sequences']:7d} {r['method']:10} {r['max_over_mean']:9.4f} "
            f"{r['padding']:8.1%} {r['microbatches_per_rank']:8d} {r['fillers']:7d} {plan}"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        machine=machine(),
        budget=BUDGET,
        cost=dict(linear=cost.linear, quadratic=cost.quadratic),
        model_shape=QWEN3_8B,
        command="python benchmarks/batching_balance.py",
    )
    OUT.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

"""Copy bandwidth of a weight version's tensor pairs on one GPU: PairCopy (one launch) vs torch._foreach_copy_.

Run on a GPU:
    python benchmarks/pair_copy.py --out benchmarks/results/pair_copy.json

Pairs as a receiver meets them: sources are back-to-back views of one staging buffer, destinations separate
parameters. Shapes: the expert tensors of 12 Qwen3-30B-A3B layers (4,608 of 768 x 2048 bf16) and the
weights of a Qwen3-8B (dense, 399 tensors). Ceiling: one contiguous copy of the same bytes. Prints GB/s of data
copied (each byte is read once and written once) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from streamrl.weights import pair_copy
from streamrl.weights.pair_copy import PairCopy

SHAPES = {
    "moe-experts": [(768, 2048)] * (12 * 128 * 3),
    "dense-8b": [(151936, 4096)] * 2 + [(4096 + 2 * 1024, 4096), (4096, 4096), (2 * 12288, 4096), (4096, 12288)] * 36,
}


def _median_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


def _measure(name: str, shapes: list[tuple[int, int]], repeats: int) -> dict:
    numels = [rows * cols for rows, cols in shapes]
    staging = torch.randn(sum(numels), device="cuda").to(torch.bfloat16)
    sources = [piece.view(shape) for piece, shape in zip(staging.split(numels), shapes, strict=True)]
    destinations = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for shape in shapes]
    flat = torch.empty_like(staging)
    copies = PairCopy(destinations, sources)
    nbytes = staging.numel() * staging.element_size()
    seconds = {
        "contiguous copy (ceiling)": _median_seconds(lambda: flat.copy_(staging), repeats),
        "torch._foreach_copy_": _median_seconds(lambda: torch._foreach_copy_(destinations, sources), repeats),
        "PairCopy.copy": _median_seconds(copies.copy, repeats),
        "PairCopy.swap": _median_seconds(copies.swap, repeats),
    }
    assert not pair_copy._kernel_failed
    copies.copy()
    assert all(torch.equal(d, s) for d, s in zip(destinations, sources, strict=True))
    print(f"\n{name}: {len(shapes)} tensors, {nbytes / 1e9:.2f} GB bf16, {torch.cuda.get_device_name(0)}")
    for method, s in seconds.items():
        print(f"  {method:<28}{s * 1e3:>8.2f} ms{nbytes / s / 1e9:>9.0f} GB/s")
    return {"tensors": len(shapes), "bytes": nbytes, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pair_copy.json"))
    args = parser.parse_args()
    results = {}
    for name, shapes in SHAPES.items():
        results[name] = _measure(name, shapes, args.repeats)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

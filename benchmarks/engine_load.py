"""A real vLLM engine loading a new weight version: layerwise reload vs recorded copy plan vs streamed swaps.

Run on one GPU with vLLM installed (the device kit):
    python benchmarks/engine_load.py --layers 4 --repeats 5 --out benchmarks/results/engine_load.json

Writes a Qwen3-30B-A3B-shaped model cut to `--layers` layers (128 experts of FFN 768, hidden 2048) as an HF
checkpoint, starts `VLLMEngine` on it in bf16, and times, per version of the same tensor list (bf16, on the GPU,
as a receiver stages them):
- layerwise: vLLM's in-place layerwise reload (`initialize_layerwise_reload` → `load_weights` → finalize), what
  every version cost before the copy plan and what the first version still costs (it records the plan);
- planned: `streamrl_apply_weights` once the plan is recorded: one multi-tensor copy;
- streamed: the same version swapped in bucket by bucket (`--bucket-mb`), as `rollout.weight_apply=streamed`
  does while the buckets arrive, then committed;
and checks that after each path the engine's log-probs of a fixed response are identical. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SHAPE = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    vocab_size=151936,
)


def _write_model(out: Path, layers: int) -> Path:
    from streamrl.models.tiny import write_tiny_model

    write_tiny_model(out, arch="qwen3_moe", num_layers=layers, **SHAPE)
    return out


def _version(model_dir: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor, bf16 on the GPU, perturbed by `seed` so versions differ."""
    from safetensors.torch import load_file

    generator = torch.Generator(device="cuda").manual_seed(seed)
    named = []
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(file), device="cuda").items():
            noise = torch.randn(tensor.shape, generator=generator, device="cuda") * 1e-3
            named.append((name, (tensor + noise).to(torch.bfloat16)))
    return named


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_load.json"))
    args = parser.parse_args()
    from streamrl.rollout.engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _write_model(Path(tmp) / "model", args.layers)
        engine = VLLMEngine(model_dir, kv_cache_bytes=2 << 30, max_model_len=512, dtype="bfloat16")
        versions = [_version(model_dir, seed) for seed in (1, 2)]
        nbytes = sum(t.numel() * t.element_size() for _, t in versions[0])
        prompt, response = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]
        timings: dict[str, list[float]] = {}

        def layerwise(named: list[tuple[str, torch.Tensor]]) -> None:
            engine.llm.collective_rpc(lambda w: w._streamrl_layerwise_load(w.model_runner.get_model(), named))

        def streamed(named: list[tuple[str, torch.Tensor]], version: int) -> None:
            assert engine.begin_streamed_load()
            bucket, size = [], 0
            for name, tensor in named:  # buckets of the plan's inputs, in order, as a receiver hands them over
                bucket.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
                if size >= args.bucket_mb << 20:
                    engine.load_bucket(bucket)
                    bucket, size = [], 0
            if bucket:
                engine.load_bucket(bucket)
            assert engine.end_streamed_load(version)

        # The plan is recorded on the first version's tensors, which play the receiver's kept staging buffers:
        # each later version is first copied into them (untimed, as a receive would fill them).
        staging = versions[0]
        contents = [[t.clone() for _, t in versions[0]], [t for _, t in versions[1]]]

        def stage(k: int) -> list[tuple[str, torch.Tensor]]:
            torch._foreach_copy_([t for _, t in staging], contents[k])
            return staging

        seconds, first = _timed(lambda: engine.load_weights(1, staging))
        print("first version:", first)
        timings["first (layerwise + record)"] = [seconds]
        for trial in range(args.repeats):
            # Alternate the contents so that every timed load changes the weights.
            named = stage(1)
            timings.setdefault("layerwise", []).append(_timed(lambda named=named: layerwise(named))[0])
            named = stage(0)
            seconds, stats = _timed(lambda named=named, trial=trial: engine.load_weights(10 + trial, named))
            assert stats["path"] == "planned", stats
            timings.setdefault("planned", []).append(seconds)
            named = stage(1)
            seconds, _ = _timed(lambda named=named, trial=trial: streamed(named, 100 + trial))
            timings.setdefault("streamed", []).append(seconds)
            engine.load_weights(200 + trial, stage(0))
        # One version through each path: identical log-probs.
        layerwise(stage(1))
        after_layerwise = engine.score(prompt, response)
        engine.load_weights(5000, stage(0))
        engine.load_weights(5001, stage(1))
        after_planned = engine.score(prompt, response)
        engine.load_weights(5002, stage(0))
        streamed(stage(1), 5003)
        after_streamed = engine.score(prompt, response)
        exact = after_layerwise == after_planned == after_streamed
        parity = max(
            abs(a - b) for a, b in zip(after_layerwise + after_layerwise, after_planned + after_streamed, strict=True)
        )

    median = {path: statistics.median(values) for path, values in timings.items()}
    print(
        f"\nengine load: qwen3-30b-a3b shape, {args.layers} layers, {len(versions[0])} tensors, "
        f"{nbytes / 1e9:.2f} GB bf16, {torch.cuda.get_device_name(0)}"
    )
    print(f"{'path':<28}{'seconds':>10}{'GB/s':>9}{'vs layerwise':>14}")
    for path, seconds in median.items():
        print(f"{path:<28}{seconds:>10.4f}{nbytes / seconds / 1e9:>9.1f}{median['layerwise'] / seconds:>14.1f}")
    print(
        f"log-probs after layerwise / planned / streamed loads of one version identical: {exact} "
        f"(max diff between paths {parity:.2e})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "layers": args.layers,
                "tensors": len(versions[0]),
                "bytes": nbytes,
                "gpu": torch.cuda.get_device_name(0),
                "median_seconds": median,
                "all_seconds": timings,
                "identical_logprobs": exact,
                "max_logprob_diff": parity,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

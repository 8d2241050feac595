"""Weight publish throughput on GPUs: our bucketed publish vs a raw NCCL broadcast vs one tensor at a time.

Run on a machine with >= 2 GPUs (GPU 0 = learner, GPUs 1.. = receivers):
    python benchmarks/weight_publish.py --model qwen3-8b --out benchmarks/results/weight_publish.json

The learner process builds a real Megatron GPTModel (fp32 master weights; for the MoE model the experts are
stacked) from a Qwen3-shaped HF config with random weights and publishes it through the production path:
`stream_hf_weights` (TP gather, fused QKV / gate-up split, experts one by one, HF names), cast to bf16,
`WeightGroup.publish` (double-buffered buckets over a standalone NCCL group). Receivers stage the whole version
(`WeightGroup.receive`) and then load it into preallocated HF-layout parameters of their own through a `CopyPlan`
recorded from their staging, as a vLLM engine does after its first version (`PairCopy`: one kernel launch). The
`-hf` model skips the learner: its HF tensors are created on the GPU directly (bucketing + transfer + load only).

In the same run, the same receivers time:
- ceiling: a raw NCCL broadcast of the same number of bytes from one flat buffer, in 1 GiB pieces;
- bucketed: every publish after the first at a bucket size (layouts planned once, payloads only; each timed one
  follows an untimed one at its size, as in a run that publishes at one size: the receiver's staging is kept);
- streamed: `rollout.weight_apply=streamed`: the receiver swaps each bucket into its parameters as it arrives
  (`StreamedLoad` over a `CopyPlan` recorded from its staging; the engine pauses for the transfer instead);
- first: a publish at a bucket size never used before (the layouts travel with the buckets; loaded with one
  `torch._foreach_copy_`, as no copy plan exists for new staging);
- naive: as verl-style syncs do, every HF tensor converted and broadcast on its own, the receiver loading each
  tensor as it arrives (which could leave an engine half updated: no staging).
Each figure is the median of `--repeats` trials, timed from a barrier to the last receiver's load; "transfer"
rows stop when the whole version is staged on the receiver, "load" rows time the load copy alone (the engine's
pause: the transfer itself runs while the engine keeps decoding), "convert only" the learner's gather/convert
stream with nothing sent (the publisher's floor).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=151936,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    attention_bias=False,
)
MODELS = {
    # Qwen3-8B: 36 layers, hidden 4096, 32 heads / 8 KV heads of 128, FFN 12288, vocab 151936.
    "qwen3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
    ),
    # Qwen3-30B-A3B cut to 12 of its 48 layers (128 experts of FFN 768 each): 4,608 expert tensors of 3 MB.
    "qwen3-30b-a3b-12layers": dict(QWEN3_MOE, num_hidden_layers=12),
}
# The same expert-heavy layers as HF tensors made on the GPU: bucketing + transfer + load without gather/convert.
MOE_LAYERS = {"qwen3-30b-a3b-12layers-hf": 12}
GiB = 1 << 30
# Parameter bytes (bf16) of models we extrapolate to.
EXTRAPOLATE = {"Qwen3-30B-A3B": 30.5e9 * 2, "Qwen3-235B-A22B": 235e9 * 2, "DeepSeek-V3 (671B)": 671e9 * 2}


def hf_config(name: str) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        **MODELS[name],
    }


def plan(args: argparse.Namespace, trial: int) -> list[tuple[str, int]]:
    """(label, bucket budget) of every publish of a trial, in order. A timed publish at a planned budget follows an
    untimed one at the same budget (`_PRIME`), as in a run that always publishes at one size: the receiver's kept
    staging is then that plan's. "first" uses a budget never used before, so its layouts must travel."""
    largest = max(args.bucket_mb) << 20
    publishes = []
    for mb in args.bucket_mb:
        publishes += [(_PRIME, mb << 20), (f"bucketed {mb} MiB", mb << 20)]
    publishes += [(_PRIME, largest), (_WARM, largest), (f"streamed {max(args.bucket_mb)} MiB", largest)]
    return [*publishes, (f"first {max(args.bucket_mb)} MiB", largest - 16 * (trial + 1))]


_PRIME = "prime"  # an untimed publish that re-stages its plan on the receiver (and there records a copy plan)
_WARM = "warm"  # an untimed streamed publish: the copy plan's per-bucket tables are built once, as in a long run


def moe_tensors(layers: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    h, experts, ffn, heads, kv, hd = 2048, 128, 768, 32, 4, 128
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (heads * hd, h)),
            (f"{p}.self_attn.k_proj.weight", (kv * hd, h)),
            (f"{p}.self_attn.v_proj.weight", (kv * hd, h)),
            (f"{p}.self_attn.o_proj.weight", (h, heads * hd)),
            (f"{p}.mlp.gate.weight", (experts, h)),
        ]
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            shapes += [
                (f"{q}.gate_proj.weight", (ffn, h)),
                (f"{q}.up_proj.weight", (ffn, h)),
                (f"{q}.down_proj.weight", (h, ffn)),
            ]
    return [(n, torch.randn(s, device=device, dtype=torch.bfloat16)) for n, s in shapes]


def _barrier(group: dist.ProcessGroup, device: torch.device) -> None:
    flag = torch.zeros(1, device=device)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([flag], options).wait()
    torch.cuda.synchronize(device)


def _learner(args: argparse.Namespace, world: int, port: int, queue: mp.Queue) -> None:
    from streamrl.config import LearnerConfig
    from streamrl.learner.hf.convert import stream_hf_weights
    from streamrl.learner.model.gpt import build_gpt_model
    from streamrl.learner.parallel import init_parallel
    from streamrl.weights.transport import WeightGroup

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    if args.model in MOE_LAYERS:
        tensors = moe_tensors(MOE_LAYERS[args.model], device)
        hf_stream = lambda: iter(tensors)  # noqa: E731
    else:
        init_parallel(LearnerConfig(collective_timeout_s=600.0), 0, "127.0.0.1", port + 1, seed=0)
        config = hf_config(args.model)
        model = build_gpt_model(config)
        hf_stream = lambda: stream_hf_weights(model, config, dtype=torch.bfloat16)  # noqa: E731
    group = WeightGroup("127.0.0.1", port, 0, world, 0, 600.0, device="cuda")
    total = sum(t.numel() * 2 for _, t in hf_stream())
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.group.broadcast([torch.tensor([total], device=device)], options).wait()  # receivers size the ceiling
    ceiling = torch.empty(GiB, dtype=torch.uint8, device=device).random_()
    convert: list[float] = []
    for trial in range(args.repeats + 1):  # trial 0 warms up NCCL and the allocator
        _barrier(group.group, device)
        sent = 0
        while sent < total:
            piece = min(GiB, total - sent)
            group.group.broadcast([ceiling[:piece]], options)
            sent += piece
        _barrier(group.group, device)
        for _, budget in plan(args, trial):
            _barrier(group.group, device)
            group.publish(trial, hf_stream(), budget)
            _barrier(group.group, device)
        _barrier(group.group, device)
        for _, tensor in hf_stream():  # naive: one broadcast per tensor, as it comes out of the converter
            group.group.broadcast([tensor.contiguous()], options)
        _barrier(group.group, device)
        start = time.perf_counter()  # the gather/convert alone, sending nothing: the publisher's own floor
        for _ in hf_stream():
            pass
        torch.cuda.synchronize(device)
        if trial:
            convert.append(time.perf_counter() - start)
    queue.put((0, {"convert only (learner)": convert}))


def _load(destination: dict[str, torch.Tensor], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A load without a copy plan (a tensor list never seen): one multi-tensor copy into the parameters."""
    torch._foreach_copy_([destination[name] for name, _ in tensors], [tensor for _, tensor in tensors])


def _load_each(destination: dict[str, torch.Tensor], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """The same load one tensor at a time, as an engine's loader does it (what a `CopyPlan` records)."""
    for name, tensor in tensors:
        destination[name].copy_(tensor)


def _receiver(rank: int, args: argparse.Namespace, world: int, port: int, queue: mp.Queue) -> None:
    from streamrl.weights.copy_plan import CopyPlan, StreamedLoad
    from streamrl.weights.transport import WeightGroup

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = WeightGroup("127.0.0.1", port, rank, world, 0, 600.0, device="cuda")
    options = dist.BroadcastOptions()
    options.rootRank = 0
    total = torch.zeros(1, dtype=torch.int64, device=device)
    group.group.broadcast([total], options).wait()
    total_bytes = int(total.item())
    timings: dict[str, list[float]] = {"bytes": [total_bytes]}
    destination: dict[str, torch.Tensor] = {}
    ceiling = torch.empty(GiB, dtype=torch.uint8, device=device)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for trial in range(args.repeats + 1):
        _barrier(group.group, device)
        start = time.perf_counter()
        received = 0
        while received < total_bytes:
            piece = min(GiB, total_bytes - received)
            group.group.broadcast([ceiling[:piece]], options).wait()
            received += piece
        _barrier(group.group, device)
        if trial:
            timings.setdefault("ceiling", []).append(time.perf_counter() - start)
        copy_plan = None
        for label, _ in plan(args, trial):
            _barrier(group.group, device)
            start = time.perf_counter()
            streamed = label == _WARM or label.startswith("streamed")
            if streamed:
                stream = StreamedLoad(copy_plan)
                _, tensors = group.receive(on_bucket=stream.bucket)  # each bucket swapped in as it arrives
                assert stream.broken is None, stream.broken
            else:
                _, tensors = group.receive()
            torch.cuda.synchronize(device)
            received_at = time.perf_counter()
            if not destination:  # the engine's parameters, allocated once (not inside any timed span after trial 0)
                destination.update((name, torch.empty_like(tensor)) for name, tensor in tensors)
            if label == _PRIME:  # the staging this plan's next publishes reuse: record the load from it, as an engine
                copy_plan, problem = CopyPlan.record(
                    functools.partial(_load_each, destination, tensors), tensors, destination.values()
                )
                assert copy_plan is not None and copy_plan.swap_problem() is None, problem
                copy_plan.replay(tensors)  # builds the replay's tables once
            elif label.startswith("bucketed"):
                copy_plan.replay(tensors)  # the engine's load once its copy plan is recorded
            elif label.startswith("first"):
                _load(destination, tensors)  # a new tensor list: no copy plan for it yet
            torch.cuda.synchronize(device)
            loaded_at = time.perf_counter()
            _barrier(group.group, device)
            if trial and label not in (_PRIME, _WARM):
                timings.setdefault(label, []).append(time.perf_counter() - start)
                if not streamed:
                    timings.setdefault(f"{label} transfer", []).append(received_at - start)
                    timings.setdefault(f"{label} load", []).append(loaded_at - received_at)
            shapes = [(n, tuple(t.shape)) for n, t in tensors]
        _barrier(group.group, device)
        start = time.perf_counter()
        for name, shape in shapes:  # naive: receive each tensor into a fresh buffer and load it at once
            tensor = torch.empty(shape, dtype=torch.bfloat16, device=device)
            group.group.broadcast([tensor], options).wait()
            destination[name].copy_(tensor)
        torch.cuda.synchronize(device)
        _barrier(group.group, device)
        if trial:
            timings.setdefault("naive per-tensor", []).append(time.perf_counter() - start)
    queue.put((rank, timings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS) + sorted(MOE_LAYERS))
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/weight_publish.json"))
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # these hosts forbid NVLink multicast
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")  # no heartbeat noise when the learner exits first
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit("weight_publish: needs at least 2 GPUs (learner + receiver)")
    from streamrl.net import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_learner, args=(args, world, port, queue))]
    procs += [ctx.Process(target=_receiver, args=(r, args, world, port, queue)) for r in range(1, world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in range(world))
    for p in procs:
        p.join(120)
    learner = results.pop(0)
    report(args, sorted(results.items()), learner, world)


def report(args: argparse.Namespace, per_receiver: list, learner: dict[str, list[float]], world: int) -> None:
    total_bytes = per_receiver[0][1].pop("bytes")[0]
    for _, timings in per_receiver[1:]:
        timings.pop("bytes")
    gb = total_bytes / 1e9
    # The publish is done when the slowest receiver has loaded: take the max over receivers per trial.
    methods = per_receiver[0][1].keys()
    median = {m: statistics.median(max(t[m][i] for _, t in per_receiver) for i in range(args.repeats)) for m in methods}
    median.update({m: statistics.median(t) for m, t in learner.items()})
    ceiling, naive = median["ceiling"], median["naive per-tensor"]
    print(f"\nweight publish: {args.model}, {gb:.2f} GB bf16, {world - 1} receiver(s), {torch.cuda.get_device_name(0)}")
    print(f"{'method':<28}{'seconds':>9}{'GB/s':>9}{'vs raw':>9}{'vs naive':>10}")
    for m, s in median.items():
        moves_bytes = not m.endswith(("load", "(learner)"))  # a load or a conversion alone sends nothing
        ratios = f"{ceiling / s:>9.2f}{naive / s:>10.2f}" if moves_bytes else ""
        print(f"{m:<28}{s:>9.3f}{gb / s:>9.1f}{ratios}")
    planned = [m for m in median if m.startswith("bucketed") and not m.endswith(("transfer", "load"))]
    best = min(planned, key=median.__getitem__)
    streamed = next(m for m in median if m.startswith("streamed"))
    rates = {
        "with load": total_bytes / median[best],
        "transfer": total_bytes / median[f"{best} transfer"],
        "streamed": total_bytes / median[streamed],
    }
    extrapolated = {kind: {n: b / rate for n, b in EXTRAPOLATE.items()} for kind, rate in rates.items()}
    print(f"\nextrapolated full publish at the rates of {best} (with load / transfer only) and {streamed}:")
    for name, nbytes in EXTRAPOLATE.items():
        seconds = " / ".join(f"{extrapolated[kind][name]:.2f}" for kind in rates)
        print(f"  {name:<20} {nbytes / 1e9:>7.0f} GB  {seconds} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "model": args.model,
                "bytes": total_bytes,
                "receivers": world - 1,
                "gpu": torch.cuda.get_device_name(0),
                "median_seconds": median,
                "gbps": {m: gb / s for m, s in median.items()},
                "extrapolated_seconds": extrapolated,
                "extrapolated_from": best,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

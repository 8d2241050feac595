"""Learner step throughput and MFU on one GPU: the production micro-batch path on RL-length packed sequences.

Run on a GPU machine (megatron-core importable):
    python benchmarks/learner_mfu.py --shape qwen3-8b --layers 16
    python benchmarks/learner_mfu.py --shape qwen3-30b-a3b --layers 12 --tokens-per-microbatch 32768 --profile
    python benchmarks/learner_mfu.py --shape qwen3-medium --groups 32 --mean-len 24 --max-len 128 --prompt-len 32

It builds a Megatron GPTModel of the `--shape` (bf16 parameters, `--layers` of the real model's 36 / 48) with our
packed-sequence attention (and, for the MoE shape, our grouped-GEMM experts), makes trajectory groups with
RL-like response lengths (lognormal around `--mean-len`, long tail capped at `--max-len`), plans them with the
production planner (`plan_step`, packed micro-batches of `--tokens-per-microbatch`), and times full steps: log-prob
forward, PPO/IS loss, backward, AdamW. MFU counts model FLOPs only (no recomputation), with the learner's own
formula (`streamrl.learner.perf.training_flops` over `streamrl.batching.cost.flops_cost_model`); for a sequence of
L tokens:

    forward = 2 * L * (layers * P_layer + hidden * vocab) + 2 * layers * heads * head_dim * L^2
    P_layer = hidden * head_dim * (2 * heads + 2 * kv_heads)          q, o, k, v projections
            + 3 * hidden * ffn                                        dense SwiGLU MLP, or for MoE:
            + top_k * 3 * hidden * moe_ffn + hidden * experts         the top-k routed experts a token runs + router
    (causal attention: QK^T and AV over on average L/2 keys, 2 * (2 * L/2 * heads * head_dim) per token and
    layer), training = 3 * forward. Experts a token is not routed to cost nothing: MoE MFU counts active FLOPs.

The denominator is the bf16 dense peak, both the datasheet figure (989 TFLOP/s for H100/H200 SXM) and a
large bf16 matmul measured in the same run. `--profile` adds a torch.profiler table of one step's top GPU kernels.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from streamrl.models.tiny import PRESETS, VOCAB_SIZE

SHAPES = {  # HF config fields of the released models, less the layer count
    # the end-to-end GPU configs' ~0.2B model: `streamrl.models.tiny`'s medium preset and its 64-token vocabulary
    "qwen3-medium": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        **{key: value for key, value in PRESETS["medium"].items() if key != "num_hidden_layers"},
        vocab_size=VOCAB_SIZE,
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
}
DATASHEET_BF16_TFLOPS = 989.0


def hf_config(shape: str, layers: int) -> dict:
    return {
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "vocab_size": 151936,
        "num_hidden_layers": layers,
        **SHAPES[shape],
    }


def measured_matmul_tflops(device: torch.device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize(device)
    return 20 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def profile_step(step: Callable[[], float], seconds: float, path: Path) -> str:
    """One step under torch.profiler: the share of the step the GPU was busy, the top GPU kernels by own time, the
    aten ops (forward and backward) that launched them, and where the GPU waited for the host (`gpu_idle`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_idle import idle_report

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    ops = [e for e in events if e.key.startswith("aten::") and e.self_device_time_total > 0]
    busy = sum(k.self_device_time_total for k in kernels) / 1e6

    def top(rows: list, count: int, title: str) -> list[str]:
        rows = sorted(rows, key=lambda e: -e.self_device_time_total)[:count]
        return [f"{title}:", f"{'GPU ms':>9}{'share':>7}{'calls':>7}  name"] + [
            f"{e.self_device_time_total / 1e3:>9.1f}{e.self_device_time_total / 1e6 / busy:>7.1%}{e.count:>7}  "
            f"{e.key[:150]}"
            for e in rows
        ]

    lines = [f"GPU kernel time {busy:.3f} s of a {seconds:.3f} s step ({busy / seconds:.0%} busy)"]
    lines += top(kernels, 25, "top kernels") + top(ops, 25, "top ops (own kernels' time)")
    lines += idle_report(prof.events())
    path.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def report(result: dict, shape: str) -> None:
    print(
        f"\nlearner step on {result['gpu']}: {shape} shape, {result['layers']} layers, "
        f"{result['params'] / 1e9:.2f} B params (bf16), {result['active_params'] / 1e9:.2f} B active per token"
    )
    print(
        f"{'tokens/step':>12}{'mb budget':>10}{'mbs':>5}{'step s':>9}{'tok/s':>10}{'TFLOP/s':>9}{'MFU(989)':>10}"
        f"{'matmul':>8}{'MFU(meas)':>10}{'peak GiB':>9}"
    )
    print(
        f"{result['tokens']:>12}{result['tokens_per_microbatch']:>10}{result['microbatches']:>5}{result['step_seconds']:>9.3f}"
        f"{result['tokens_per_s']:>10.0f}{result['model_tflops']:>9.1f}{result['mfu_datasheet']:>10.3f}"
        f"{result['matmul_tflops']:>8.0f}{result['mfu_measured']:>10.3f}{result['peak_memory_gib']:>9.1f}"
    )


def make_groups(args: argparse.Namespace, vocab: int, seed: int = 0) -> list:
    from streamrl.types import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(args.groups):
        prompt = rng.integers(0, vocab, args.prompt_len).astype(np.int32)
        lengths = np.clip(rng.lognormal(np.log(args.mean_len), 0.8, args.n), 16, args.max_len).astype(int)
        trajs = tuple(
            Trajectory(
                rng.integers(0, vocab, L).astype(np.int32),
                -rng.random(L).astype(np.float32),
                np.zeros(L, np.int32),
                float(rng.random()),
                "stop",
            )
            for L in lengths
        )
        groups.append(TrajectoryGroup.from_responses(f"g{g}", "bench", prompt, trajs))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=16, help="fewer than the real model's, to fit one GPU")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="responses per group")
    parser.add_argument("--mean-len", type=int, default=1500)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--tokens-per-microbatch", type=int, default=16384, help="the planner's micro-batch budget")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="print one step's top GPU kernels")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/learner_mfu_<shape>.json")
    args = parser.parse_args()
    out = args.out or Path(f"benchmarks/results/learner_mfu_{args.shape}.json")

    from streamrl.batching.cost import flops_cost_model
    from streamrl.batching.microbatch import plan_step
    from streamrl.config import LearnerConfig
    from streamrl.learner.model.gpt import build_gpt_model
    from streamrl.learner.model.logprobs import microbatch_logprobs
    from streamrl.learner.parallel import init_parallel
    from streamrl.learner.perf import training_flops
    from streamrl.loss.grpo import policy_loss
    from streamrl.net import free_port

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init_parallel(LearnerConfig(collective_timeout_s=600.0), 0, "127.0.0.1", free_port(), seed=0)
    cfg = hf_config(args.shape, args.layers)
    model = build_gpt_model(cfg, params_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    groups = make_groups(args, cfg["vocab_size"])
    (microbatches,) = plan_step(groups, 1, args.tokens_per_microbatch, "token_mean")
    seq_lens = [len(g.prompt_ids) + n for g in groups for n in g.lengths]
    cost = flops_cost_model(cfg)
    flops = training_flops(cost, microbatches)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        for mb in microbatches:
            logp = microbatch_logprobs(model, mb)
            as_t = lambda array: torch.from_numpy(array).to(device, non_blocking=True)  # noqa: E731
            loss, _ = policy_loss(
                logp, logp.detach(), as_t(mb.behaviour_logprobs), as_t(mb.advantages), as_t(mb.loss_weight), 0.2, 2.0
            )
            loss.backward()
        optimizer.step()
        return float(loss)

    step()  # warm-up: allocator, kernels
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = float(np.median(times))
    matmul = measured_matmul_tflops(device)
    achieved = flops / seconds / 1e12
    result = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "shape": args.shape,
        "layers": args.layers,
        "params": sum(p.numel() for p in model.parameters()),
        "active_params": cost.linear / 2,
        "tokens": sum(seq_lens),
        "step_flops": flops,
        "sequences": len(seq_lens),
        "tokens_per_microbatch": args.tokens_per_microbatch,
        "microbatches": len(microbatches),
        "step_seconds": seconds,
        "tokens_per_s": sum(seq_lens) / seconds,
        "model_tflops": achieved,
        "mfu_datasheet": achieved / DATASHEET_BF16_TFLOPS,
        "matmul_tflops": matmul,
        "mfu_measured": achieved / matmul,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    report(result, args.shape)
    if args.profile:
        print(profile_step(step, seconds, out.with_suffix(".profile.txt")))


if __name__ == "__main__":
    main()

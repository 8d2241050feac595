"""Learner step throughput and MFU on one GPU: the production micro-batch path on RL-length packed sequences.

Run on a GPU machine (megatron-core importable):
    python benchmarks/learner_mfu.py --layers 16 --out benchmarks/results/learner_mfu.json

It builds a Qwen3-8B-shaped Megatron GPTModel (bf16 parameters, `--layers` of the 36) with our
packed-sequence attention, makes trajectory groups with RL-like response lengths (lognormal around
`--mean-len`, long tail capped at `--max-len`), plans them with the production planner
(`plan_step`, packed micro-batches of `--tokens-per-microbatch`), and times full steps: log-prob
forward, PPO/IS loss, backward, AdamW. MFU counts model FLOPs only (no recomputation):

    per token, forward = 2 * P_matmul + 2 * L_ctx * heads * head_dim * layers * 2 / 2 + 2 * hidden * vocab
    (P_matmul = matrix parameters of the layers; causal attention: QK^T and AV over on average L/2 keys,
    i.e. 2 * (2 * L/2 * heads * head_dim) per layer per token), training = 3 * forward.

The denominator is the bf16 dense peak, both the datasheet figure (989 TFLOP/s for H100/H200 SXM) and a
large bf16 matmul measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

QWEN3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936)  # fmt: skip
DATASHEET_BF16_TFLOPS = 989.0


def hf_config(layers: int) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "max_position_embeddings": 32768, "tie_word_embeddings": False, "hidden_act": "silu",
            "num_hidden_layers": layers, **QWEN3_8B}  # fmt: skip


def step_flops(cfg: dict, seq_lens: list[int]) -> float:
    h, heads, kv, hd, ffn, v, n = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                   cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"],
                                   cfg["num_hidden_layers"])  # fmt: skip
    per_layer = h * hd * (heads + 2 * kv) + heads * hd * h + 3 * h * ffn
    tokens = sum(seq_lens)
    dense = 2 * (n * per_layer + h * v) * tokens
    attention = sum(2 * L * heads * hd * n for L in seq_lens)  # 2 matmuls x 2 flops x L/2 keys, summed over tokens
    return 3.0 * (dense + attention)


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


def make_groups(args: argparse.Namespace, vocab: int) -> list:
    from streamrl.types import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(0)
    groups = []
    for g in range(args.groups):
        prompt = rng.integers(0, vocab, 256).astype(np.int32)
        lengths = np.clip(rng.lognormal(np.log(args.mean_len), 0.8, args.n), 16, args.max_len).astype(int)
        trajs = tuple(Trajectory(rng.integers(0, vocab, L).astype(np.int32), -rng.random(L).astype(np.float32),
                                 np.zeros(L, np.int32), float(rng.random()), "stop") for L in lengths)  # fmt: skip
        groups.append(TrajectoryGroup(f"g{g}", "bench", prompt, trajs))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="responses per group")
    parser.add_argument("--mean-len", type=int, default=1500)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--tokens-per-microbatch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/learner_mfu.json"))
    args = parser.parse_args()

    from streamrl.batching.microbatch import plan_step
    from streamrl.learner.logprobs import microbatch_logprobs
    from streamrl.learner.model import build_gpt_model
    from streamrl.learner.parallel import init_parallel
    from streamrl.loss.grpo import policy_loss
    from streamrl.net import free_port

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init_parallel(0, 1, 1, "127.0.0.1", free_port(), 600.0, seed=0)
    cfg = hf_config(args.layers)
    model = build_gpt_model(cfg, params_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    groups = make_groups(args, cfg["vocab_size"])
    (microbatches,) = plan_step(groups, 1, args.tokens_per_microbatch, "token_mean")
    seq_lens = [len(g.prompt_ids) + len(t.response_ids) for g in groups for t in g.trajectories]
    flops = step_flops(cfg, seq_lens)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        for mb in microbatches:
            logp = microbatch_logprobs(model, mb)
            as_t = lambda array: torch.from_numpy(array).to(device, non_blocking=True)  # noqa: E731
            loss, _ = policy_loss(logp, logp.detach(), as_t(mb.behaviour_logprobs), as_t(mb.advantages),
                                  as_t(mb.loss_weight), 0.2, 2.0)  # fmt: skip
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
        "gpu": torch.cuda.get_device_name(device), "layers": args.layers,
        "params": sum(p.numel() for p in model.parameters()), "tokens": sum(seq_lens),
        "sequences": len(seq_lens), "microbatches": len(microbatches), "step_seconds": seconds,
        "tokens_per_s": sum(seq_lens) / seconds, "model_tflops": achieved,
        "mfu_datasheet": achieved / DATASHEET_BF16_TFLOPS, "matmul_tflops": matmul, "mfu_measured": achieved / matmul,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
    }  # fmt: skip
    print(f"\nlearner step on {result['gpu']}: Qwen3-8B shape, {args.layers} layers, "
          f"{result['params'] / 1e9:.2f} B params (bf16)")  # fmt: skip
    print(f"{'tokens/step':>12}{'mbs':>5}{'step s':>9}{'tok/s':>10}{'TFLOP/s':>9}{'MFU(989)':>10}{'matmul':>8}"
          f"{'MFU(meas)':>10}{'peak GiB':>9}")  # fmt: skip
    print(f"{result['tokens']:>12}{result['microbatches']:>5}{seconds:>9.3f}{result['tokens_per_s']:>10.0f}"
          f"{achieved:>9.1f}{result['mfu_datasheet']:>10.3f}{matmul:>8.0f}{result['mfu_measured']:>10.3f}"
          f"{result['peak_memory_gib']:>9.1f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

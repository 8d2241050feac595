"""The requests of one vLLM engine by id, filled output by output: what every kind of engine shares.

Contract
--------
- `RequestTable` is the base of the engines (`engine.VLLMEngine`: one vLLM engine driven step by step;
  `data_parallel_engine.DataParallelEngine`: vLLM's data-parallel ranks). A subclass gives `_enqueue(request_id, prompt,
  params)` (hand one request to vLLM) and `step()`, which hands every output vLLM made since the last
  call to `_record` and must not return while outputs of the weights running before a version change are still
  untaken: `_record` stamps every token with `policy_version` as it is now.
- `submit(request_id, prompt_ids, n, max_tokens, ...)` queues a prompt for `n` samples; `pop_finished()` hands back
  completed requests as lists of `Sample`s. `Sample.logprobs[i]` is the behaviour log-prob of `token_ids[i]` as
  sampled (`logprobs_mode="processed_logprobs"`: after temperature, and top-p/top-k renormalisation when set).
- `keep_kv` (an engine started with `rollout.kv_on_update=keep`): requests in flight are not restarted at a version
  (the subclass skips its cache reset), and every request is handed to vLLM with its version as the cache salt
  (`_prompt`), so that a new request reuses no prefix block that older weights computed.
- `generate(...)` and `score(...)` are built on the same table, so they can run while other requests are in flight
  without stealing their outputs.
- Sleep (an engine started with `sleep_mode`, colocated on the learner's GPUs): `sleep()` frees the engine's GPU
  memory while no request runs (weights to the host, KV cache dropped: vLLM's level 1, which keeps the old weights so
  that a version refused before its first bucket still leaves the engine able to run) and returns the bytes freed on
  its GPUs; `wake(tags)` brings back "weights" (for a publish), then "kv_cache" (None: both); `sleeping` is true until
  both are back. A subclass gives `_free_memory()` (free bytes on each of its GPUs), `_sleep()` and `_wake_up(tags)`.
- `trajectory_group(...)`: a finished request's samples and rewards as the `TrajectoryGroup` the stream carries.
- `outputs_recorded` counts vLLM's outputs taken into the table (each carries new tokens, or a request's end).
- `lost()`: whether a process of the engine's vLLM died, seen without asking it anything (the rollout worker's loop
  looks each turn, so an engine with nothing to decode is replaced too); the next call would raise `EngineLost`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamrl.types import Trajectory, TrajectoryGroup


class EngineLost(RuntimeError):
    """The engine cannot sample any more (its vLLM failed, or its weights are a mix of versions): replace it."""


@dataclass
class Sample:
    """One generated completion."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob of each sampled token
    versions: list[int] = field(default_factory=list)  # policy version each token was sampled under
    text: str = ""
    finish_reason: str = ""  # "stop" (EOS / stop token) or "length"
    routes: Any = None  # with `record_routes`: uint8/16[prompt + tokens - 1, layers, k] experts chosen, at the end

    def input_routes(self, prompt_length: int) -> np.ndarray | None:
        """The recorded experts when they cover every input position (else None: the group then trains without
        replay rather than with experts at the wrong positions)."""
        if self.routes is None or len(self.routes) != prompt_length + len(self.token_ids) - 1:
            return None
        return np.asarray(self.routes)


def trajectory_group(
    request_id: str, engine_id: str, prompt_ids: list[int], samples: list[Sample], rewards: np.ndarray
) -> TrajectoryGroup:
    """The group of one finished request: its samples with their rewards, as the stream carries them."""
    responses = [
        Trajectory(
            np.asarray(s.token_ids, np.int32),
            np.asarray(s.logprobs, np.float32),
            np.asarray(s.versions, np.int32),
            float(reward),
            s.finish_reason if s.finish_reason in ("stop", "length") else "abort",
            s.input_routes(len(prompt_ids)),
        )
        for s, reward in zip(samples, rewards.tolist(), strict=True)
    ]
    return TrajectoryGroup.from_responses(request_id, engine_id, np.asarray(prompt_ids), responses)


class RequestTable(abc.ABC):
    """Requests in flight and finished, and the policy version the engine's weights correspond to."""

    sleep_mode = False  # set by a subclass started with vLLM's sleep mode
    keep_kv = False  # set by a subclass started with kv_on_update="keep"

    def __init__(self) -> None:
        self._asleep: set[str] = set()  # what a sleeping engine has freed and not brought back yet
        self.policy_version: int = 0
        self._running: dict[str, list[Sample]] = {}  # request id -> its n samples, filled step by step
        self._finished: dict[str, list[Sample]] = {}
        self._prompt_logprobs: dict[str, list[Any]] = {}
        self._next_id = 0
        self.outputs_recorded = 0  # vLLM's outputs of requests in the table so far (the rollout worker's stall watch)

    @abc.abstractmethod
    def _enqueue(self, request_id: str, prompt: Any, params: Any) -> None:
        """Hand one request (`prompt`: vLLM's `TokensPrompt`) to vLLM."""

    @abc.abstractmethod
    def step(self) -> None:
        """Take vLLM's new outputs into the table (`_record`), stamped with the current policy version."""

    def lost(self) -> bool:
        """Whether a process of this engine's vLLM died (module docstring); an engine in this process: never."""
        return False

    # -- sleep (colocated) --------------------------------------------------------------------------
    def sleep(self) -> int:
        """Free this engine's GPU memory while no request runs; returns the bytes freed on its GPUs."""
        if not self.sleep_mode:
            raise RuntimeError("engine: sleep needs an engine started with sleep_mode")
        if self.has_unfinished():
            raise RuntimeError("engine: cannot sleep while requests run")
        before = sum(self._free_memory())
        self._sleep()
        self._asleep = {"weights", "kv_cache"}
        return sum(self._free_memory()) - before

    @property
    def sleeping(self) -> bool:
        return bool(self._asleep)

    def wake(self, tags: list[str] | None = None) -> None:
        """Bring back `tags` ("weights", "kv_cache"; None: all) of a sleeping engine; it runs once all are back."""
        waking = sorted(self._asleep if tags is None else self._asleep & set(tags))
        if waking:
            self._wake_up(waking)
            self._asleep -= set(waking)

    @abc.abstractmethod
    def _free_memory(self) -> list[int]:
        """Free bytes on each of the engine's GPUs."""

    @abc.abstractmethod
    def _sleep(self) -> None:
        """vLLM's sleep level 1 on every worker."""

    @abc.abstractmethod
    def _wake_up(self, tags: list[str]) -> None:
        """vLLM's wake-up of `tags` on every worker."""

    # -- requests -----------------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        detokenize: bool = True,
        exact_length: int | None = None,
    ) -> None:
        """Queue one prompt for `n` samples of up to `max_tokens` (of exactly `exact_length`, EOS ignored); they come
        back from `pop_finished()` under `request_id`. Without `detokenize`, vLLM builds no text as it samples."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=n,
            max_tokens=exact_length or max_tokens,
            ignore_eos=exact_length is not None,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            detokenize=detokenize,
        )
        self._add(request_id, prompt_token_ids, params, n)

    def _add(self, request_id: str, prompt_token_ids: list[int], params: Any, n: int) -> None:
        if request_id in self._running or request_id in self._finished:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._enqueue(request_id, self._prompt(list(prompt_token_ids)), params)
        self._running[request_id] = [Sample() for _ in range(n)]

    def _prompt(self, prompt_token_ids: list[int]) -> Any:
        """vLLM's prompt of these tokens; with `keep_kv` salted with the current version, as vLLM's prefix cache keeps
        the blocks of every version (none is dropped at a version then) and hashes the salt into a prompt's first."""
        from vllm.inputs import TokensPrompt

        if self.keep_kv:
            return TokensPrompt(prompt_token_ids=prompt_token_ids, cache_salt=f"v{self.policy_version}")
        return TokensPrompt(prompt_token_ids=prompt_token_ids)

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def _record(self, outputs: Iterable[tuple[str, Any]]) -> None:
        """Fill the table from vLLM's (request id, RequestOutput) pairs; new tokens get the current policy version."""
        for request_id, out in outputs:
            samples = self._running.get(request_id)
            if samples is None:
                continue
            self.outputs_recorded += 1
            if request_id in self._prompt_logprobs:  # a scoring request: only its prompt log-probs matter
                self._prompt_logprobs[request_id].extend(out.prompt_logprobs or [])
            else:
                for completion in out.outputs:
                    self._extend(samples[completion.index], completion)
            if out.finished:
                self._finished[request_id] = self._running.pop(request_id)

    def _extend(self, sample: Sample, completion: Any) -> None:
        token_ids = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise RuntimeError("vLLM returned no per-token logprobs for a completion (logprobs=0 was requested)")
        logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, token_ids, strict=True)]
        if not all(math.isfinite(lp) for lp in logprobs):
            raise RuntimeError(f"vLLM returned a non-finite behaviour logprob: {logprobs}")
        sample.token_ids += token_ids
        sample.logprobs += logprobs
        sample.versions += [self.policy_version] * len(token_ids)
        sample.text += completion.text
        if completion.finish_reason is not None:
            sample.finish_reason = str(completion.finish_reason)
        routes = getattr(completion, "routed_experts", None)  # only on the finishing output
        if routes is not None:
            sample.routes = routes

    def pop_finished(self, request_ids: list[str] | None = None) -> dict[str, list[Sample]]:
        """Completed requests (all of them, or just `request_ids` that are done), removed from the table."""
        keys = list(self._finished) if request_ids is None else [r for r in request_ids if r in self._finished]
        return {key: self._finished.pop(key) for key in keys}

    def _run_until_done(self, request_ids: list[str]) -> dict[str, list[Sample]]:
        while not all(r in self._finished for r in request_ids):
            self.step()
        return self.pop_finished(request_ids)

    def _fresh_id(self, kind: str) -> str:
        self._next_id += 1
        return f"{kind}-{self._next_id}"

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int = 1,
        max_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[list[Sample]]:
        """Sample `n` completions per prompt and wait for them (other requests keep running)."""
        ids = [self._fresh_id("generate") for _ in prompt_token_ids]
        for request_id, prompt in zip(ids, prompt_token_ids, strict=True):
            self.submit(request_id, prompt, n, max_tokens, temperature, top_p, seed)
        done = self._run_until_done(ids)
        return [done[r] for r in ids]

    def score(self, prompt_token_ids: list[int], response_token_ids: list[int]) -> list[float]:
        """Log-prob of each response token given the prompt and the preceding response tokens."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: need at least one token to condition on")
        if not response_token_ids:
            return []
        sequence = list(prompt_token_ids) + list(response_token_ids)
        request_id = self._fresh_id("score")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, output_kind=RequestOutputKind.DELTA)
        self._prompt_logprobs[request_id] = []
        self._add(request_id, sequence, params, 1)
        self._run_until_done([request_id])
        # prompt_logprobs[i] is None for i == 0, else a dict that contains sequence[i]'s entry.
        positions = self._prompt_logprobs.pop(request_id)[len(prompt_token_ids) :]
        return [entry[token].logprob for entry, token in zip(positions, response_token_ids, strict=True)]

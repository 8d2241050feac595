"""A rollout engine process: prompts → vLLM → rewards → Redis stream, continuously.

`RolloutWorker.run()` loops until `stop()`: it takes `prompts_per_batch` prompts from the resumable
prompt stream, samples `n` responses each with the running policy, scores them and pushes one
TrajectoryGroup per prompt. `update_weights` runs on another thread of the same actor; a lock
makes it wait for the batch being sampled, so a version is applied whole between batches and every
token of a batch carries the version it was sampled under.
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np

from streamrl.config import Config
from streamrl.queue.stream import QueueKeys, TrajectoryProducer, connect
from streamrl.rewards import build_reward
from streamrl.rollout.prompts import PromptSource
from streamrl.types import Trajectory, TrajectoryGroup


class RolloutWorker:
    def __init__(self, config: Config, engine_index: int, redis_url: str, redis_password: str | None):
        from transformers import AutoTokenizer

        from streamrl.rollout.engine import VLLMEngine

        self.config, self.engine_id = config, f"engine-{engine_index}"
        rollout = config.rollout
        self.engine = VLLMEngine(
            str(config.model.path), kv_cache_bytes=rollout.kv_cache_bytes, max_model_len=rollout.max_model_len,
            dtype=rollout.dtype, seed=config.run.seed + engine_index,
        )  # fmt: skip
        self.tokenizer = AutoTokenizer.from_pretrained(str(config.model.path))
        self.prompts = PromptSource(config.task, seed=config.run.seed * 1000 + engine_index)
        self.reward = build_reward(config.task)
        client = connect(redis_url, redis_password)
        self.producer = TrajectoryProducer(
            client, QueueKeys(config.run.name), config.queue.max_backlog, config.queue.wait_timeout_s
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.groups_pushed = self.tokens_generated = 0
        self.generate_s = 0.0

    def ready(self) -> str:
        return self.engine_id

    def policy_version(self) -> int:
        return self.engine.policy_version

    def _sample_batch(self) -> list[TrajectoryGroup]:
        rollout = self.config.rollout
        prompts = [next(self.prompts) for _ in range(rollout.prompts_per_batch)]
        prompt_ids = [
            self.tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
            for p in prompts
        ]  # fmt: skip
        start = time.perf_counter()
        with self._lock:
            version = self.engine.policy_version
            samples = self.engine.generate(prompt_ids, rollout.n, rollout.max_tokens, rollout.temperature,
                                           rollout.top_p, seed=None)  # fmt: skip
        self.generate_s += time.perf_counter() - start
        groups = []
        for prompt, ids, group_samples in zip(prompts, prompt_ids, samples, strict=True):
            trajectories = tuple(
                Trajectory(
                    response_ids=np.asarray(s.token_ids, dtype=np.int32),
                    logprobs=np.asarray(s.logprobs, dtype=np.float32),
                    versions=np.full(len(s.token_ids), version, dtype=np.int32),
                    reward=float(self.reward(s.text, prompt.answer)),
                    finish_reason=s.finish_reason if s.finish_reason in ("stop", "length") else "abort",
                )
                for s in group_samples
            )
            self.tokens_generated += sum(len(t.response_ids) for t in trajectories)
            groups.append(TrajectoryGroup(uuid.uuid4().hex, self.engine_id, np.asarray(ids, np.int32), trajectories))
        return groups

    def run(self) -> int:
        """Generate until stopped; returns the number of groups pushed."""
        while not self._stop.is_set():
            groups = self._sample_batch()
            self.producer.push(groups)
            self.groups_pushed += len(groups)
        return self.groups_pushed

    def stop(self) -> None:
        self._stop.set()

    def update_weights(self, version: int, buckets: list[bytes]) -> int:
        """Apply a whole published version between batches; returns the version now running."""
        with self._lock:
            self.engine.load_weights(version, buckets)
        return self.engine.policy_version

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """The running policy's logprob of each response token (for parity checks)."""
        with self._lock:
            return self.engine.score(prompt_ids, response_ids)

    def stats(self) -> dict[str, float]:
        return {
            "rollout/groups_pushed": self.groups_pushed,
            "rollout/tokens_generated": self.tokens_generated,
            "rollout/generate_s": self.generate_s,
            "rollout/backpressure_wait_s": self.producer.backpressure_wait_s,
            "rollout/engine_version": self.engine.policy_version,
        }

"""Process placement: the Redis server, a Ray instance, engine actors and learner-rank actors.

`Cluster` is a context manager: on enter it starts (or connects to) Redis, starts local Ray
(dashboard off) or joins `RAY_ADDRESS`, creates the engines and learner ranks and waits for them
(bounded), then starts every engine's generation loop. On exit it stops the loops, kills the
actors it created, shuts Ray down and stops the Redis server it started. Every wait names what it
was waiting for when it times out.
"""

from __future__ import annotations

import os
from typing import Any

from streamrl.config import Config
from streamrl.queue.server import EmbeddedRedis, free_port
from streamrl.queue.stream import QueueKeys, connect


class Cluster:
    def __init__(self, config: Config):
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.engines: list[Any] = []
        self.learners: list[Any] = []
        self.engine_loops: list[Any] = []
        self._started_ray = False

    def __enter__(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        import ray

        from streamrl.learner.worker import LearnerWorker
        from streamrl.rollout.worker import RolloutWorker

        config = self.config
        if config.queue.url is None:
            self.redis = EmbeddedRedis(config.run.dir / "redis", config.queue.appendfsync).start()
            self.redis_url, self.redis_password = self.redis.url, self.redis.password
        else:
            self.redis_url, self.redis_password = config.queue.url, os.environ.get(config.queue.password_env)
        self.redis_client = connect(self.redis_url, self.redis_password)
        if not ray.is_initialized():
            # Actors inherit these: one intra-op thread each, since ranks and engines share the cores.
            env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": config.wandb.mode}
            ray.init(include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": env},
                     object_store_memory=512 << 20, configure_logging=False)  # fmt: skip
            self._started_ray = True
        world = config.learner.tensor_parallel * config.learner.data_parallel
        port = config.learner.master_port or free_port()
        engine_cls = ray.remote(RolloutWorker).options(num_cpus=0, max_concurrency=4)
        learner_cls = ray.remote(LearnerWorker).options(num_cpus=0)
        self.engines = [engine_cls.remote(config, i, self.redis_url, self.redis_password)
                        for i in range(config.rollout.engines)]  # fmt: skip
        self.learners = [learner_cls.remote(config, r, world, "127.0.0.1", port, self.redis_url, self.redis_password)
                         for r in range(world)]  # fmt: skip
        self.get([e.ready.remote() for e in self.engines], config.rollout.start_timeout_s, "engine start-up")
        self.get([r.ready.remote() for r in self.learners], config.learner.step_timeout_s, "learner start-up")
        self.announce_version(0)
        self.engine_loops = [e.run.remote() for e in self.engines]

    def get(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        """ray.get with a bound; a timeout names `what`, and a dead engine loop surfaces its error first."""
        import ray

        self._check_engine_loops()
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._check_engine_loops()
            raise TimeoutError(f"{what}: no answer within {timeout_s}s") from None

    def _check_engine_loops(self) -> None:
        import ray

        done, _ = ray.wait(self.engine_loops, num_returns=len(self.engine_loops), timeout=0)
        for ref in done:
            ray.get(ref)  # raises the engine's exception
            raise RuntimeError("rollout: an engine loop stopped on its own")

    def learner_step(self, step: int) -> dict[str, float]:
        results = self.get([r.step.remote() for r in self.learners], self.config.learner.step_timeout_s,
                           f"learner step {step}")  # fmt: skip
        return results[0]

    def engine_stats(self) -> dict[str, float]:
        stats = self.get([e.stats.remote() for e in self.engines], 30.0, "engine stats")
        # Counters add up over engines; for versions the laggard is what matters.
        return {key: (min if key.endswith("version") else sum)(s[key] for s in stats) for key in stats[0]}

    def announce_version(self, version: int) -> None:
        """The latest complete version, for engines that join later and for operators."""
        self.redis_client.set(QueueKeys(self.config.run.name).policy_version, version)

    def __exit__(self, *exc: object) -> None:
        import ray

        try:
            if self.engines:
                ray.get([e.stop.remote() for e in self.engines], timeout=30)
                ray.wait(self.engine_loops, num_returns=len(self.engine_loops), timeout=60)
        except Exception:  # noqa: BLE001 - teardown continues whatever state the actors are in
            pass
        for actor in self.engines + self.learners:
            ray.kill(actor)
        self.engines, self.learners = [], []
        if self._started_ray:
            ray.shutdown()
        if self.redis is not None:
            self.redis.stop()

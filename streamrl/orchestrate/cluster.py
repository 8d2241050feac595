"""Process placement and fault handling: Redis, Ray, engine actors, learner-rank actors.

`Cluster` is a context manager. On enter it starts (or connects to) Redis, starts local Ray
(dashboard off) or joins `RAY_ADDRESS`, creates engines and learner ranks, waits for them
(bounded), has its publisher (`streamrl.weights.Publisher`) form the weight groups (one per pipeline stage: the
stage's first learner rank sends its layers, every engine receives from every stage) and starts every engine's
generation loop. On exit it stops the loops, kills the actors it created, shuts Ray down and stops the Redis server
it started. The cluster is the publisher's fleet: it supplies the actors and replaces dead engines.

Faults: an engine whose actor died (found by a failed publish or a finished loop) is dropped; the
weight groups are rebuilt for the survivors (a new generation) and the publish is retried, so one
dead engine never blocks the learner beyond `train.publish_timeout_s`. With
`rollout.restart_dead_engines` a replacement starts in its slot; it reads the announced version
from Redis, sees it lags, and the next publish carries the learner's weights to it. A learner rank that died is
found by the step that waits on it (`LearnerDied`, `learner_group.py`): `restart_learners` restarts the whole
learner group from its checkpoint and step journal while the engines keep generating. The learner is asked to step
only once the stream completes the step (the driver waits, supervising the engines: an engine lost while every other
is lost too would otherwise leave the learner waiting for groups nobody samples).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from streamrl.config import Config
from streamrl.logs import stderr_to_run_logs
from streamrl.net import PORT_RANGE_VAR
from streamrl.orchestrate.engine_report import engines_report
from streamrl.orchestrate.learner_group import LearnerGroup
from streamrl.orchestrate.placement import Placement, check_shared_dir
from streamrl.orchestrate.redis_watch import RedisWatch
from streamrl.queue import EmbeddedRedis, QueueKeys, connect_for, grant_prompts, reset_budgets
from streamrl.weights import Publisher

logger = logging.getLogger(__name__)

# The driver's wait for a step's groups: each ask of the learner waits this long for the stream, and between two asks
# the driver looks for dead engines.
_ADMISSION_POLL_MS = 200


class Cluster:
    def __init__(self, config: Config):
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.engines: list[Any] = []  # slot i holds the actor of engine i (replaced on restart)
        self.engine_loops: list[Any] = []
        self.learner_group: LearnerGroup | None = None
        self.publisher = Publisher(self, config)
        self.engines_restarted = 0
        self.restarting: set[int] = set()  # engine slots being replaced right now
        self.slot_restarts: dict[int, int] = {}  # engine slot -> restarts so far (the backoff doubles with each)
        self.redis_watch: RedisWatch | None = None
        self._started_ray = False
        self.placement: Placement | None = None

    def __enter__(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        import ray

        from streamrl.rollout import RolloutWorker

        config = self.config
        self._start_ray()
        self._start_redis()
        self.redis_client = connect_for(config.queue, self.redis_url, self.redis_password)
        self.keys = QueueKeys(config.run.name)
        reset_budgets(self.redis_client, self.keys)  # an earlier run's sync budgets are void (see the module)
        if config.cluster.nodes > 1:
            check_shared_dir(config.cluster.shared_dir, config.cluster.placement_timeout_s)
        self.placement = Placement.reserve(config)
        self._engine_cls = ray.remote(RolloutWorker)
        self.engines = [self._new_engine(i) for i in range(config.rollout.engines)]
        self.learner_group = LearnerGroup(config, self.placement, self.redis_url, self.redis_password)
        self.learner_group.start()
        engines = self.get([e.ready.remote() for e in self.engines], config.rollout.start_timeout_s, "engine start-up")
        self._record_placement(engines, self.learner_group.ready)
        self.announce_version(0)
        self.publisher.form_groups()
        self.engine_loops = [e.run.remote() for e in self.engines]

    def _start_ray(self) -> None:
        """Join `ray.address` (or $RAY_ADDRESS) without local-only arguments, or start a local Ray instance."""
        import ray

        if ray.is_initialized():
            return
        # Actors inherit these: one intra-op thread each, since ranks and engines share the cores.
        env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": self.config.wandb.mode}
        if os.environ.get(PORT_RANGE_VAR):  # the actors' rendezvous ports, on every node, in the driver's range
            env[PORT_RANGE_VAR] = os.environ[PORT_RANGE_VAR]
        # The actors write their own output to run.dir/logs unless run.verbose (streamrl.logs).
        verbose = self.config.run.verbose
        common = {"runtime_env": {"env_vars": env}, "log_to_driver": verbose, "configure_logging": False}
        address = self.config.ray.address or os.environ.get("RAY_ADDRESS")
        with stderr_to_run_logs(self.config.run.dir, "ray", verbose):
            if address:
                ray.init(address=address, **common)
            else:
                # "local": a new instance even where a `ray start` cluster runs (ray.init() alone would join it).
                store = self.config.ray.object_store_bytes
                ray.init(address="local", include_dashboard=False, object_store_memory=store, **common)
        self._started_ray = True

    def _start_redis(self) -> None:
        """The embedded server (bound to this node's address when other nodes must reach it), or queue.url."""
        import ray

        config = self.config
        if config.queue.url is not None:
            self.redis_url, self.redis_password = config.queue.url, os.environ.get(config.queue.password_env)
            return
        host = "127.0.0.1"
        if config.cluster.nodes > 1:
            host = ray.util.get_node_ip_address()
            if host.startswith("127."):
                raise RuntimeError(
                    f"queue.url: the embedded Redis would bind {host}, which other nodes cannot reach; set queue.url "
                    "to a Redis every node reaches"
                )
        self.redis = EmbeddedRedis(config.run.dir / "redis", config.queue.appendfsync, host=host).start()
        self.redis_url, self.redis_password = self.redis.url, self.redis.password
        self.redis_watch = RedisWatch(self.redis)

    def _record_placement(self, engines: list[dict[str, Any]], learners: list[dict[str, Any]]) -> None:
        """Where each actor runs, for operators and tests: RUN_DIR/placement.json."""
        record = {"engines": engines, "learners": learners}
        (self.config.run.dir / "placement.json").write_text(json.dumps(record, indent=1))

    def _new_engine(self, index: int) -> Any:
        options = self.placement.engine_options(index)
        return self._engine_cls.options(max_concurrency=8, **options).remote(
            self.config, index, self.redis_url, self.redis_password, self.placement.engine_env(index)
        )

    def get(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        """ray.get with a bound; a timeout names `what`."""
        import ray

        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{what}: no answer within {timeout_s}s") from None

    # -- engines ----------------------------------------------------------------------------------
    def replace_dead_engines(self) -> bool:
        """Find engines whose actor died; restart (or drop) them. True if any was dead."""
        import ray

        dead = []
        for index, engine in enumerate(self.engines):
            try:
                ray.get(engine.policy_version.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(index)
        self.restarting = set(dead)
        rollout = self.config.rollout
        for index in reversed(dead):
            logger.warning("engine-%d is dead", index)
            ray.kill(self.engines[index])
            if rollout.restart_dead_engines:
                if self.engines_restarted >= rollout.max_engine_restarts:
                    raise RuntimeError(
                        f"rollout.max_engine_restarts: engine-{index} died after {self.engines_restarted} restarts "
                        f"(the budget is {rollout.max_engine_restarts}); see {self.config.run.dir / 'logs'}"
                    )
                earlier = self.slot_restarts.get(index, 0)
                time.sleep(min(rollout.restart_backoff_s * 2**earlier, 60.0))
                self.slot_restarts[index] = earlier + 1
                self.engines[index] = self._new_engine(index)
                self.get([self.engines[index].ready.remote()], rollout.start_timeout_s, f"restart of engine-{index}")
                self.engine_loops[index] = self.engines[index].run.remote()
                self.engines_restarted += 1
            else:
                del self.engines[index], self.engine_loops[index]
        self.restarting = set()
        if dead:
            self.publisher.stale = True
        if not self.engines:
            raise RuntimeError("rollout: every engine is dead")
        return bool(dead)

    def engine_health(self) -> dict[str, str]:
        """Each engine's state for /healthz: up (loop running, actor answering within a second), restarting or
        down. Safe to call from another thread of the driver."""
        import ray

        engines, loops, restarting = list(self.engines), list(self.engine_loops), set(self.restarting)
        done, _ = ray.wait(loops, num_returns=len(loops), timeout=0) if loops else ([], [])
        pings = [engine.policy_version.remote() for engine in engines]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=1.0) if pings else ([], [])
        states = {}
        for index, (loop, ping) in enumerate(zip(loops, pings, strict=True)):
            answered = ping in ready and not isinstance(_error(ping), Exception)
            alive = loop not in done and answered
            states[f"engine-{index}"] = "restarting" if index in restarting else "up" if alive else "down"
        return states

    def node_address(self) -> str:
        """This (the driver's) node's address, as other nodes reach it."""
        import ray

        return ray.util.get_node_ip_address()

    def check_engines(self) -> None:
        """Surface an engine loop that stopped: a dead actor is replaced, an exception is raised here."""
        import ray

        done, _ = ray.wait(self.engine_loops, num_returns=len(self.engine_loops), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                self.replace_dead_engines()
                return
            raise RuntimeError("rollout: an engine loop stopped on its own")

    def announce_version(self, version: int) -> None:
        """The latest complete version, for engines that join later and for operators."""
        self.redis_client.set(self.keys.policy_version, version)

    # -- steps and stats --------------------------------------------------------------------------
    @property
    def learners(self) -> list[Any]:
        """The learner ranks' actors (new ones after a restart of the group)."""
        return self.learner_group.ranks if self.learner_group is not None else []

    def learner_step(self, step: int) -> dict[str, float]:
        """Step `step` on every learner rank; rank 0's metrics. Async, the driver first waits until the stream
        completes the step (`wait_for_step_data`). A dead rank raises `LearnerDied`."""
        self.check_engines()
        waited = self.wait_for_step_data(step - 1) if self.config.train.mode == "async" else 0.0
        return self.learner_group.step(step, waited)

    def wait_for_step_data(self, version: int) -> float:
        """Async: until the stream completes the next step of a learner at `version` (bounded by
        `queue.wait_timeout_s`); an engine lost meanwhile is replaced and, unless the engines run a newer version
        (after a learner restart), gets `version`: with every engine lost, nothing else would fill the step. Returns
        the seconds waited."""
        start = time.perf_counter()
        timeout = self.config.queue.wait_timeout_s
        while not self.learner_group.step_ready(_ADMISSION_POLL_MS):
            self.check_engines()
            self._bring_replacements_to(version)
            if time.perf_counter() - start > timeout:
                what = f"the stream did not complete step {version + 1} within {timeout}s"
                raise TimeoutError(f"learner: {what}; {engines_report(self.engines)}")
        return time.perf_counter() - start

    def check_learners(self) -> None:
        """Raise `LearnerDied` if a learner rank is gone (the publisher asks after a failed publish)."""
        self.learner_group.check()

    def restart_learners(self, reason: BaseException) -> None:
        """Restart the learner group after a rank died (see `LearnerGroup.restart`); the engines keep generating and
        join new weight groups at the next publish."""
        self.learner_group.restart(reason)
        self.publisher.stale = True

    def allow_prompts(self, groups: int) -> None:
        """Sync mode: the engines may start `groups` more prompts between them (split as evenly as can be), a budget
        in Redis that a replaced engine inherits (`streamrl.queue.sync_budget`)."""
        engines = len(self.engines)
        for index in range(engines):
            share = groups // engines + (index < groups % engines)
            grant_prompts(self.redis_client, self.keys, f"engine-{index}", share)

    def wait_for_step_groups(self, version: int) -> dict[str, float]:
        """Sync mode: until every engine has pushed the groups of its budget and they complete the step (bounded by
        `queue.wait_timeout_s`): the learner admits them meanwhile, and each group it refuses (constant rewards) is
        one more prompt for its engine. An engine that dies meanwhile (or was replaced since the last publish) is
        replaced and gets `version`, the weights the step starts from, before it starts its predecessor's prompts
        again; returns the seconds waited."""
        import ray

        start = time.perf_counter()
        timeout = self.config.queue.wait_timeout_s
        while True:
            self._bring_replacements_to(version)  # a replacement samples only under the announced version
            try:
                done = self.get([e.step_done.remote() for e in self.engines], timeout, "engines' step groups")
            except ray.exceptions.RayActorError:
                self.replace_dead_engines()
                continue
            if all(done) and self.learner_group.step_ready():
                return {"perf/generate_wait_s": time.perf_counter() - start}
            if time.perf_counter() - start > timeout:
                what = f"the engines did not push the step's groups within {timeout}s"
                raise TimeoutError(f"sync mode: {what}; {engines_report(self.engines)}")
            time.sleep(0.05)

    def _bring_replacements_to(self, version: int) -> None:
        """While the driver waits for a step's groups: engines replaced since the last publish (new weight groups due)
        get `version`, the learner's weights, unless the engines run a newer one (after a learner restart, until it
        is past them). Colocated, the learner's state goes back to the host after the publish."""
        if not self.publisher.stale or version < int(self.redis_client.get(self.keys.policy_version) or 0):
            return
        self.publisher.publish(version)
        if self.config.colocated:  # the publish brought the learner's state back to its GPUs
            self.park_learners()

    def sleep_engines(self) -> dict[str, float]:
        """Colocated, once the step's groups are pushed: the engines free their GPUs for the learner; returns the
        seconds it took and the memory freed on all GPUs (an engine found dead is replaced, and its replacement
        sleeps)."""
        start = time.perf_counter()
        freed = self._on_every_engine("sleep", (), "engine sleep")
        return {"perf/engine_sleep_s": time.perf_counter() - start, "rollout/sleep_freed_gb": sum(freed) / 1e9}

    def park_learners(self) -> dict[str, float]:
        """Colocated: every learner rank moves its training state to host memory for the engines' turn (a no-op
        without CUDA); returns the seconds and the GB parked on all ranks. A dead rank raises `LearnerDied`."""
        start = time.perf_counter()
        parked = self.learner_group.call("park", (), "learner park")
        return {"perf/learner_park_s": time.perf_counter() - start, "learner/parked_gb": sum(parked)}

    def wake_engines(self, tags: list[str] | None = None) -> float:
        """Colocated: the engines bring back `tags` of what sleep freed (None: all); returns the seconds it took. An
        engine found dead is replaced (awake; the next publish brings it the weights)."""
        start = time.perf_counter()
        self._on_every_engine("wake", (tags,), "engine wake-up")
        return time.perf_counter() - start

    def _on_every_engine(self, method: str, args: tuple, what: str) -> list[Any]:
        """`method(*args)` on every engine (bounded by `train.publish_timeout_s`); if one is dead, it is replaced and
        the call made again."""
        import ray

        def call() -> list[Any]:
            refs = [getattr(engine, method).remote(*args) for engine in self.engines]
            return self.get(refs, self.config.train.publish_timeout_s, what)

        try:
            return call()
        except ray.exceptions.RayActorError:
            self.replace_dead_engines()
            return call()

    def engine_stats(self) -> dict[str, float]:
        """Every engine's counters merged; an engine that died since the step began is replaced first (its
        replacement's counters start again, the restart is counted)."""
        import ray

        try:
            stats = self.get([e.stats.remote() for e in self.engines], 30.0, "engine stats")
        except ray.exceptions.RayActorError:
            self.replace_dead_engines()
            stats = self.get([e.stats.remote() for e in self.engines], 30.0, "engine stats")
        # Counters add up over engines; for versions the laggard is what matters, for start-up the slowest.
        merge = {"rollout/engine_version": min, "rollout/engine_start_s": max}
        merged = {key: merge.get(key, sum)(s[key] for s in stats) for key in stats[0]}
        merged["rollout/engines_restarted"] = self.engines_restarted
        merged["queue/redis_restarts"] = self.redis_watch.restarts if self.redis_watch is not None else 0
        return merged

    def __exit__(self, *exc: object) -> None:
        import ray

        try:
            if self.engines:
                ray.get([e.stop.remote() for e in self.engines], timeout=30)
                ray.wait(self.engine_loops, num_returns=len(self.engine_loops), timeout=60)
        except Exception:  # noqa: BLE001 - teardown continues whatever state the actors are in
            pass
        for actor in self.engines:
            ray.kill(actor)
        self.engines = []
        if self.learner_group is not None:
            self.learner_group.kill()
        if self.placement is not None:
            self.placement.remove()
        if self._started_ray:
            ray.shutdown()
        if self.redis_watch is not None:
            self.redis_watch.stop()
        if self.redis is not None:
            self.redis.stop()


def _error(ref: Any) -> Any:
    """The exception a finished Ray call raised, or its result."""
    import ray

    try:
        return ray.get(ref, timeout=0)
    except Exception as exc:  # noqa: BLE001 - the caller only asks whether it failed
        return exc

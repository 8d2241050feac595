"""Helpers shared by the end-to-end tests: the tiny config in a temp dir, engine-vs-learner log-probs, and the
exactly-once check of a run's groups and prompts from its own records."""

import json
from pathlib import Path

import numpy as np
import ray
import redis

from streamrl.config import Config, load_config
from streamrl.orchestrate.cluster import Cluster
from streamrl.queue import QueueKeys

CONFIG = Path(__file__).parents[2] / "configs" / "tiny.yaml"
PARITY_TOL = 1e-3
# Fault tests replace dead engines at once: the backoff between restarts (2 s, doubling) is not what they test.
QUICK_RESTART = "rollout.restart_backoff_s=0.1"


def tiny_config(tmp_path: Path, *overrides: str) -> Config:
    return load_config(CONFIG, [f"run.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", *overrides])


def fixed_sample(config: Config) -> tuple[list[int], list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(config.model.path))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "repeat #"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return prompt, tokenizer.encode("##a#*#", add_special_tokens=False) + [tokenizer.eos_token_id]


def engine_logprobs(cluster: Cluster, config: Config, engine: int = 0) -> np.ndarray:
    prompt, response = fixed_sample(config)
    return np.array(ray.get(cluster.engines[engine].score.remote(prompt, response), timeout=60))


def learner_logprobs(cluster: Cluster, config: Config) -> np.ndarray:
    """The learner's log-probs of the fixed response (every rank takes part; rank 0's answer)."""
    prompt, response = fixed_sample(config)
    sequence = prompt + response
    per_rank = ray.get([r.logprobs.remote(sequence[:-1], sequence[1:]) for r in cluster.learners], timeout=60)
    return np.array(per_rank[0][len(prompt) - 1 :])


def assert_logprob_parity(cluster: Cluster, config: Config, engine: int = 0) -> None:
    """The engine's log-probs of a fixed response equal the learner's, token by token."""
    engine_lp = engine_logprobs(cluster, config, engine)
    learner_lp = learner_logprobs(cluster, config)
    assert engine_lp.shape == learner_lp.shape == (len(fixed_sample(config)[1]),)
    np.testing.assert_allclose(engine_lp, learner_lp, atol=PARITY_TOL, rtol=0)


def train_and_publish(cluster: Cluster, steps: int) -> None:
    """Steps 1..`steps`, each published to the engines."""
    for step in range(1, steps + 1):
        cluster.learner_step(step)
        cluster.publisher.publish(step)


def ledger(config: Config) -> list[dict]:
    """The run's ledger of trained steps (`RUN_DIR/trained_groups.jsonl`), one dict per step."""
    path = config.run.dir / "trained_groups.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def dropped(config: Config) -> list[str]:
    """The ids of the groups refused at admission (stale, constant rewards): `RUN_DIR/dropped_groups.jsonl`."""
    path = config.run.dir / "dropped_groups.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [group for line in lines for group in json.loads(line)["groups"]]


def assert_every_prompt_once(client: redis.Redis, config: Config) -> None:
    """No group is in the ledger twice, and every prompt before each engine's cursor made exactly one group: trained
    (in the ledger), dropped by an admission rule (with its id on record) or still in the stream; none skipped, none
    sampled twice. `client` reads the run's Redis (the job's, or the embedded server restarted on its AOF).

    The engines may still be pushing (the learner is not stepping): the cursors are read first, then the stream, then
    the ledger and the drops. A group only moves forward (pushed before its engine's cursor passes it, then trained or
    dropped), so every group below a cursor read is in one of the later reads; read the other way round, a push and a
    cursor saved between the reads looked like a skipped prompt."""
    keys = QueueKeys(config.run.name)
    cursors = {k.decode(): json.loads(v)["index"] for k, v in client.hgetall(keys.prompt_cursors).items()}
    queued = [fields[b"i"].decode() for _, fields in client.xrange(keys.stream)]
    trained = [group for row in ledger(config) for group in row["groups"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    refused = dropped(config)
    assert not set(refused) & set(trained), "a dropped group was trained"
    assert cursors, "no engine saved a prompt cursor"
    for engine, cursor in cursors.items():
        produced = trained + refused + queued
        indices = sorted(int(g.rsplit("-p", 1)[1]) for g in produced if g.startswith(f"{engine}-e0-"))
        assert len(indices) == len(set(indices)), f"{engine}: a prompt made two groups"
        assert indices[:cursor] == list(range(cursor)), f"{engine}: a prompt before its cursor {cursor} was skipped"

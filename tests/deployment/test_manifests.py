"""The deployment files parse, run only commands the CLI has with overrides the config accepts, and keep Redis
durable (append-only, noeviction, password from a secret)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from streamrl.cli import _parser
from streamrl.config import load_config

ROOT = Path(__file__).parents[2]
DEPLOYMENT = ROOT / "deployment"
MANIFESTS = sorted(DEPLOYMENT.rglob("*.yaml"))


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _streamrl_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `streamrl`) of every streamrl command line the deployment files run."""
    compose = _documents(DEPLOYMENT / "compose.yaml")[0]
    rayjob = _documents(DEPLOYMENT / "kuberay" / "rayjob.yaml")[0]
    service = (DEPLOYMENT / "systemd" / "streamrl.service").read_text()
    exec_start = next(line for line in service.splitlines() if line.startswith("ExecStart="))
    return [
        ("compose.yaml", compose["services"]["streamrl"]["command"]),
        ("kuberay/rayjob.yaml", shlex.split(rayjob["spec"]["entrypoint"])[1:]),
        ("systemd/streamrl.service", shlex.split(exec_start.removeprefix("ExecStart="))[1:]),
    ]


def test_every_manifest_parses() -> None:
    assert {p.name for p in MANIFESTS} >= {"compose.yaml", "raycluster.yaml", "rayjob.yaml", "redis.yaml"}
    for path in MANIFESTS:
        docs = _documents(path)
        assert docs, path
        for doc in docs:
            assert isinstance(doc, dict) and (path.name == "compose.yaml" or {"apiVersion", "kind"} <= doc.keys())


@pytest.mark.parametrize("where,argv", _streamrl_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_commands_exist_and_their_configs_validate(where: str, argv: list[str]) -> None:
    args, overrides = _parser().parse_known_args(argv)  # exits (fails the test) on an unknown command or flag
    assert args.command == "train", where
    config_name = Path(args.config).name
    assert (ROOT / "configs" / config_name).exists(), f"{where}: configs/{config_name} is not in the repository"
    load_config(ROOT / "configs" / config_name, [*args.overrides, *overrides])


def test_the_image_runs_the_cli() -> None:
    dockerfile = (DEPLOYMENT / "Dockerfile.gpu").read_text()
    assert 'ENTRYPOINT ["streamrl"]' in dockerfile and '".[gpu]"' in dockerfile


def test_redis_is_durable_and_password_protected() -> None:
    compose_redis = _documents(DEPLOYMENT / "compose.yaml")[0]["services"]["redis"]["command"]
    kinds = {doc["kind"]: doc for doc in _documents(DEPLOYMENT / "kuberay" / "redis.yaml")}
    statefulset = kinds["StatefulSet"]
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    for args in (compose_redis, container["args"]):
        joined = " ".join(map(str, args))
        assert "--appendonly yes" in joined and "--maxmemory-policy noeviction" in joined and "--requirepass" in joined
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "streamrl-redis"
    assert statefulset["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_docker_compose_validates_the_compose_file() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker compose is not installed here")
    result = subprocess.run(
        [docker, "compose", "-f", str(DEPLOYMENT / "compose.yaml"), "config", "--quiet"],
        env={"REDIS_PASSWORD": "test", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr

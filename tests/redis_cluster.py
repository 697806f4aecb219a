"""A real Redis Cluster on free ports, for the tests that need one: three masters, and with
``replicas=1`` one replica each (six nodes), so that a test can kill a master and see its replica
promoted."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

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

"""A real Redis Cluster of three masters (no replicas) on free ports, for the tests that need one."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from spool_cli import procs as harness

MASTERS = 3


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


@contextmanager
def redis_cluster(base: Path) -> Iterator[Cluster]:
    """Start the nodes under ``base``, join them (16384 slots split in three), wait for
    ``cluster_state:ok``; stop them all on exit."""
    procs: list[harness.Proc] = []
    ports: list[int] = []
    try:
        for i in range(MASTERS):
            data = base / f"node-{i}"
            data.mkdir(parents=True, exist_ok=True)
            bus = str(harness.free_port())  # not the default (port + 10,000): free ports go past 55,535
            proc, url = harness.start_redis(
                "--cluster-enabled", "yes", "--cluster-port", bus, data_dir=data, log_dir=data
            )
            procs.append(proc)
            ports.append(int(url.split(":")[2].split("/")[0]))
        create = ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)]
        subprocess.run([*create, "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True)
        for port in ports:  # every node, so that each already knows every slot's owner
            with redis.Redis(port=port) as node:
                harness.wait_until(
                    lambda: node.cluster("info")["cluster_state"] == "ok", "the cluster", 30, procs
                )
        yield Cluster(ports, procs)
    finally:
        harness.stop_all(procs)

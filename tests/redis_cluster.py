"""A real Redis Cluster of three masters (no replicas) on free ports, for the tests that need one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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
    ``cluster_state:ok`` (spool_cli.procs.start_redis_cluster); stop them all on exit."""
    procs, urls = harness.start_redis_cluster(MASTERS, base)
    try:
        ports = [int(url.split(":")[2].split("/")[0]) for url in urls]
        yield Cluster(ports, procs)
    finally:
        harness.stop_all(procs)

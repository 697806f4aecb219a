"""An engine step's writes: append_step.lua, one call per Redis (per master on a Redis Cluster).

A step of 32 jobs spreads over most of a cluster's buckets; a call per bucket would cost each
master some eight script calls (and round trips) per step instead of one, and a call's fixed cost
is most of what a token costs Redis (docs/benchmarks.md, "One call per master"). The script's flag lets one call span the slots of one master, so the writer groups the
step's jobs by the master that serves their bucket and sends each group to its master, all of them
in one pipeline (each call sent before any answer is read: a step waits for its slowest master,
not for each in turn; 0.95 against 1.35 ms a step of 32 jobs on 3 masters). Where the
slot map moved under it (a failover, a resharding: MOVED, ASK, TRYAGAIN, CLUSTERDOWN) or the master
cannot be reached, that group goes again as one call per bucket, which the cluster client routes
and retries as any command: the script is safe to run twice (an append already written answers 2).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import redis
from redis.cluster import ClusterNode
from redis.exceptions import (
    ConnectionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TimeoutError,
)

from common.buckets import key_slot
from common.keys import Keys
from common.store.calls import append_step_args
from common.store.records import Append
from common.store.scripts import source

G = TypeVar("G", bound=Hashable)

# What the script raises at a key of a slot the master no longer serves (the fence reads every
# bucket's attempts before any write) or of a slot it is handing over (a live resharding), and
# while the cluster is down (a failover under way), before any write too.
_NOT_HERE = (
    "Script attempted to access a non local key",
    "Script attempted to execute a command while the cluster is down",
)
# What a call sent to one master raises when the slot map changed under it or the master is gone
# (redis-py refreshes its slot map on each).
_REROUTE: tuple[type[Exception], ...] = (
    RedisClusterException,
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    ConnectionError,
    TimeoutError,
)


class StepWriter:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self.script = client.register_script(source("append_step"))
        self._cluster = isinstance(client, redis.RedisCluster)
        self._slots = [key_slot(keys.running_jobs(b)) for b in keys.bucket_range()]

    def write(self, appends: Sequence[Append], ttl_s: int) -> list[Any]:
        """The script's answers to ``appends`` (jobs, not parts), in their order."""
        if not appends:
            return []
        if not self._cluster:
            return list(self.script(*append_step_args(self.keys, appends, ttl_s)))
        cluster: redis.RedisCluster = self.client  # type: ignore[assignment]

        def master(a: Append) -> str:
            return str(
                cluster.nodes_manager.get_node_from_slot(self._slots[self.keys.bucket_of(a.job_id)]).name
            )

        groups = _grouped(appends, master)
        nodes = [cluster.get_node(node_name=name) for name in groups]
        parts = [[appends[i] for i in indexes] for indexes in groups.values()]
        if len(parts) == 1:
            return self._call(nodes[0], appends, ttl_s)
        # The masters' calls in one pipeline: each is sent before any answer is read, so a step
        # waits for its slowest master rather than for each in turn.
        pipe = cluster.pipeline(transaction=False)
        for node, part in zip(nodes, parts, strict=True):
            pipe.execute_command(
                "EVALSHA", self.script.sha, *_spanning(self.keys, part, ttl_s), target_nodes=node
            )
        try:
            answers: list[Any] = pipe.execute(raise_on_error=False)
        except RedisError as e:  # a master gone, the slot map changed: each goes again on its own
            answers = [e] * len(parts)
        # One that failed (the script not loaded there, a slot moved, a master unreachable) goes
        # again as one call, with its remedies; the script is safe to run twice.
        answers = [
            self._call(node, part, ttl_s) if isinstance(answer, Exception) else answer
            for node, part, answer in zip(nodes, parts, answers, strict=True)
        ]
        return _in_order(len(appends), groups.values(), answers)

    def _call(self, node: ClusterNode, appends: Sequence[Append], ttl_s: int) -> list[Any]:
        if len({self.keys.bucket_of(a.job_id) for a in appends}) == 1:
            # EVALSHA, routed by its keys; loads the script on NOSCRIPT
            return list(self.script(*append_step_args(self.keys, appends, ttl_s)))
        spanning = _spanning(self.keys, appends, ttl_s)
        try:
            try:
                reply = self.client.execute_command("EVALSHA", self.script.sha, *spanning, target_nodes=node)
            except NoScriptError:  # a restarted or new master: EVAL caches it there
                reply = self.client.execute_command("EVAL", self.script.script, *spanning, target_nodes=node)
        except _REROUTE:
            return self._per_bucket(appends, ttl_s)
        except ResponseError as e:
            if not any(m in str(e) for m in _NOT_HERE):
                raise
            return self._per_bucket(appends, ttl_s)
        return list(reply)

    def _per_bucket(self, appends: Sequence[Append], ttl_s: int) -> list[Any]:
        groups = _grouped(appends, lambda a: self.keys.bucket_of(a.job_id))
        answers = [
            self.script(*append_step_args(self.keys, [appends[i] for i in indexes], ttl_s))
            for indexes in groups.values()
        ]
        return _in_order(len(appends), groups.values(), answers)


def _spanning(keys: Keys, appends: Sequence[Append], ttl_s: int) -> list[Any]:
    """EVALSHA's arguments after the sha for ``appends`` of several slots of one master: no key
    declared, the keys in ARGV after their count (append_step.lua)."""
    script_keys, args = append_step_args(keys, appends, ttl_s)
    return [0, len(script_keys), *script_keys, *args]


def _grouped(appends: Sequence[Append], group_of: Callable[[Append], G]) -> dict[G, list[int]]:
    """The indexes of ``appends`` by group, in order."""
    groups: dict[G, list[int]] = {}
    for i, a in enumerate(appends):
        groups.setdefault(group_of(a), []).append(i)
    return groups


def _in_order(n: int, groups: Iterable[list[int]], answers: Iterable[Sequence[Any]]) -> list[Any]:
    """The answers of the groups' calls, in the order of the ``n`` appends they were made of."""
    replies: list[Any] = [None] * n
    for indexes, answer in zip(groups, answers, strict=True):
        for i, reply in zip(indexes, answer, strict=True):
            replies[i] = reply
    return replies

"""Every caller of a store script passes the keys and arguments that the script declares.

Each file of common/store/lua/ opens with two contract lines, ``-- KEYS: ...`` and ``-- ARGV: ...``,
a pattern of names read left to right:

    name        one value              name?       zero or one
    name*       any number             name[n]     as many as the value matched as n
    (a b)*      a group, any number    (a b)[n]    a group, n times
    ''          one empty string

A count ``n`` is a name matched before it, in ARGV (KEYS are matched after ARGV, with ARGV's names).
The pure builders (common/store/calls.py) are checked directly; the stores' other calls are
checked as they run against the real Redis, seen through a client that notes each EVALSHA.
Then luacheck lints the files with the repository's .luacheckrc, where it is installed.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
from store_helpers import StoreForTests

from common.buckets import key_slot
from common.keys import part_id
from common.schemas.events import DoneEvent, LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import JobStatus, Usage
from common.settings import Settings
from common.store import (
    Append,
    AsyncBatchStore,
    AsyncJobStore,
    Final,
    LineJob,
    LineResult,
    QueueMessage,
    append_step_args,
    cancel_args,
    create_call,
    create_parts_call,
    new_job_id,
    part_append_args,
    part_take_args,
    take_args,
    token_entry,
)
from common.store.hooks import AsyncHookStore
from common.store.scripts import names, source

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "common" / "store" / "lua"
_TOKEN = re.compile(r"\(|\)(?:\*|\?|\[\w+\])?|''|\w+(?:\?|\*|\[\w+\])?")

Node = tuple[str, Any, str]  # (kind: name | group | empty, the name or the group's nodes, quantifier)


def parse(spec: str) -> list[Node]:
    """A contract line's pattern as nodes."""
    stack: list[list[Node]] = [[]]
    for token in _TOKEN.findall(spec):
        if token == "(":
            stack.append([])
        elif token.startswith(")"):
            group = stack.pop()
            stack[-1].append(("group", group, token[1:].strip("[]")))
        elif token == "''":
            stack[-1].append(("empty", None, ""))
        else:
            name, quant = re.fullmatch(r"(\w+)(.*)", token).groups()  # type: ignore[union-attr]
            stack[-1].append(("name", name, quant.strip("[]")))
    assert len(stack) == 1, f"unbalanced: {spec}"
    assert not _TOKEN.sub("", spec).strip(), f"not a pattern: {spec}"
    return stack[0]


def _seq(
    nodes: list[Node], args: list[Any], i: int, env: dict[str, Any]
) -> Iterator[tuple[int, dict[str, Any]]]:
    if not nodes:
        yield i, env
        return
    for j, e in _node(nodes[0], args, i, env):
        yield from _seq(nodes[1:], args, j, e)


def _node(node: Node, args: list[Any], i: int, env: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    kind, body, quant = node

    def once(i: int, env: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
        if kind == "group":
            yield from _seq(body, args, i, env)
        elif i < len(args) and (kind == "name" or args[i] == ""):
            yield i + 1, {**env, body: args[i]} if kind == "name" else env

    def times(n: int, i: int, env: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
        if n == 0:
            yield i, env
            return
        for j, e in once(i, env):
            yield from times(n - 1, j, e)

    def star(i: int, env: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
        yield i, env
        for j, e in once(i, env):
            if j > i:
                yield from star(j, e)

    if quant == "":
        yield from once(i, env)
    elif quant == "?":
        yield i, env
        yield from once(i, env)
    elif quant == "*":
        yield from star(i, env)
    else:
        yield from times(int(env[quant]), i, env)


def match(spec: str, args: list[Any], env: dict[str, Any]) -> dict[str, Any] | None:
    """The names bound by a match of the whole of ``args``, or None when they do not fit."""
    for end, bound in _seq(parse(spec), args, 0, env):
        if end == len(args):
            return bound
    return None


def contract(name: str) -> tuple[str, str]:
    """The KEYS and ARGV patterns of a script, from its file's header."""
    head = (LUA / f"{name}.lua").read_text().split("\nlocal ", 1)[0]
    found = dict(re.findall(r"^-- (KEYS|ARGV): (.*)$", head, re.MULTILINE))
    return found["KEYS"], found["ARGV"]


def check(name: str, keys: list[Any], args: list[Any]) -> None:
    keys_spec, argv_spec = contract(name)
    bound = match(argv_spec, args, {})
    assert bound is not None, f"{name}: ARGV {args!r} do not fit {argv_spec!r}"
    assert match(keys_spec, keys, bound) is not None, f"{name}: KEYS {keys!r} do not fit {keys_spec!r}"


def spans_slots(name: str) -> bool:
    """Whether the script may touch keys of several slots of one master (Redis 7's flag; its
    callers group keys by master: common/store/steps.py)."""
    return source(name).startswith("#!lua flags=allow-cross-slot-keys\n")


SEEN: set[str] = set()  # the scripts checked so far in this module
PASSED: list[str] = []  # the tests below that checked calls and passed


def checked(name: str, call: tuple[list[str], list[Any]]) -> None:
    check(name, *call)
    tagged = [k for k in call[0] if "{" in k]
    if tagged and not spans_slots(
        name
    ):  # names in buckets: on a Redis Cluster the keys of a call must be in one hash slot
        assert len({key_slot(k) for k in tagged}) == 1, f"{name}: KEYS {tagged!r} span hash slots"
        # The others are broker lists ("{prefix}.llm..."): a cluster's broker is apart, and the
        # scripts write its messages on their bucket's outbox instead (common/store/outbox.py).
        assert all(k.split(":", 1)[0].count(".") for k in call[0] if "{" not in k), call[0]
    SEEN.add(name)


# -- the patterns themselves ----------------------------------------------------------------------


def test_the_matcher_reads_the_patterns() -> None:
    assert match("a b? (c d)*", [1, 2, 3, 4], {}) == {"a": 1, "b": 2, "c": 3, "d": 4}
    assert match("a b? (c d)*", [1, 2, 3], {}) is not None  # no b
    assert match("a (c d)*", [1, 2], {}) is None
    assert match("n (x m y[m])[n] z*", [2, 7, 1, 0, 8, 2, 0, 0, 9], {}) is not None
    assert match("n (x m y[m])[n]", [2, 7, 1, 0, 8, 2, 0], {}) is None  # one y short
    assert match("live* '' id*", ["a", "b", "", "x"], {}) is not None
    assert match("live* '' id*", ["a", "b"], {}) is None
    assert match("batch (job broker)[jobs]", ["b", "j", "l"], {"jobs": "1"}) is not None
    assert match("batch (job broker)[jobs]", ["b", "j", "l"], {"jobs": "2"}) is None


@pytest.mark.parametrize("name", names())
def test_each_script_declares_its_contract_and_binds_it(name: str) -> None:
    """Both contract lines, a pattern that parses, includes that resolve, and the script's first
    code line binds names (``local ... = KEYS[1]`` or ``unpack(KEYS)``/``ARGV``)."""
    keys_spec, argv_spec = contract(name)
    parse(keys_spec), parse(argv_spec)
    assert "--#include" not in source(name)  # every include resolved
    lines = (LUA / f"{name}.lua").read_text().splitlines()
    first = next(line for line in lines if line and not line.startswith(("--", "#!")))
    assert re.match(r"local .*\b(KEYS|ARGV)\b", first), f"{name}: its first code line binds no KEYS/ARGV"


# -- the builders ---------------------------------------------------------------------------------


def _entries(first: int, n: int) -> list[LogEntry]:
    return [token_entry(first + k, first + k - 1, "tok", [7]) for k in range(n)]


def _done(seq: int) -> LogEntry:
    return LogEntry.done(
        seq, DoneEvent(status=JobStatus.SUCCEEDED, finish_reason="length", usage=Usage.of(1, 2))
    )


def test_the_builders_pass_what_their_scripts_declare(settings: Settings) -> None:
    keys, now = settings.keys, time.time()
    request = JobRequest.accept({"prompt": "hi", "max_tokens": 4}, settings)
    queue = keys.model_queue("m")

    def message(i: str, held: bool = False) -> QueueMessage:
        return QueueMessage(queue, f"msg {i}", queue)

    for message_for in (None, message):
        for idem in (None, "k"):
            checked("create", create_call(keys, settings, request, "o", message_for, idem)[1])
    parts = JobRequest.accept(
        {"parts": [{"type": "text", "prompt": "hi"}, {"type": "image", "prompt": "a boat", "size": "32x32"}]},
        settings,
    )
    for idem in (None, "k"):
        checked("create_parts", create_parts_call(keys, settings, parts, "o", message, message, idem)[1])
    checked("take", take_args(keys, "j", "w", "m", now, 30.0))
    checked("part_take", part_take_args(keys, part_id("j", 1), "w", "m", now, 30.0))
    a, b, c = (new_job_id(keys, 0) for _ in range(3))  # one step's jobs of a bucket
    d = new_job_id(keys, keys.buckets - 1)  # and one of another, where there are several
    appends = [
        Append(a, 1, _entries(1, 3), 2, 3),
        Append(b, 2, _entries(1, 1), 2, 1, checkpoint=False),
        Append(
            c, 1, [*_entries(4, 1), _done(5)], 2, 1, Final(JobStatus.SUCCEEDED, "length"), unsaved_text="x"
        ),
    ]
    for some in (appends[:1], appends, [*appends, Append(d, 1, _entries(1, 1), 2, 1)]):
        checked("append_step", append_step_args(keys, some, 60))
    for a in (Append(part_id("j", 0), 1, _entries(1, 2), 2, 2), Append(part_id("j", 1), 1, [], 0, 0)):
        checked("part_append", part_append_args(keys, a, 60))
    final = Append(part_id("j", 0), 1, [_done(3)], 2, 2, Final(JobStatus.SUCCEEDED, "length"), b"png")
    checked("part_append", part_append_args(keys, final, 60))
    checked("cancel", cancel_args(keys, "j", 60))
    # A wrong count is caught.
    keys_, args = take_args(keys, "j", "w", "m", now, 30.0)
    with pytest.raises(AssertionError):
        check("take", keys_, args[:-1])
    PASSED.append("builders")


# -- the stores' own calls, as they run ------------------------------------------------------------


class Noted:
    """Notes each script call (EVALSHA) of a client, then sends it on to Redis."""

    calls: list[tuple[str, list[Any], list[Any]]]

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        self.calls.append((sha, list(keys_and_args[:numkeys]), list(keys_and_args[numkeys:])))
        return super().evalsha(sha, numkeys, *keys_and_args)  # type: ignore[misc]


class NotedSync(Noted, redis.Redis):
    pass


class NotedAsync(Noted, aredis.Redis):
    pass


def noted(cls: type[Any], url: str) -> Any:
    client = cls.from_url(url, decode_responses=True)
    client.calls = []
    return client


def check_noted(clients: list[Noted]) -> None:
    by_sha = {hashlib.sha1(source(n).encode()).hexdigest(): n for n in names()}
    for client in clients:
        assert client.calls
        for sha, keys, args in client.calls:
            checked(by_sha[sha], (keys, args))


def test_the_worker_store_passes_what_its_scripts_declare(settings: Settings) -> None:
    client = noted(NotedSync, settings.redis_url)
    store = StoreForTests(client, settings)
    try:
        queue = settings.keys.model_queue("m")
        request = JobRequest.accept({"prompt": "hi", "max_tokens": 4}, settings)
        job = store.create_job(request, "o", lambda i: QueueMessage(queue, f"msg {i}", queue), "k")
        other = store.create_job(request, "o")
        taken = store.take_job(job.id, "w", "m")
        store.take_job(other.id, "w", "m")  # running: in the attempts hash until it ends
        store.renew_leases({job.id: taken.attempt, other.id: 1})
        final = Final(JobStatus.SUCCEEDED, "length")
        store.append_batch([Append(job.id, taken.attempt, [*_entries(1, 2), _done(3)], 2, 2, final)])
        store.claim_requeue(other.id, time.time(), 0.0)
        store.release_leases("w")
        store.request_cancel(other.id)
        for to in (queue, ""):  # a job queued for a model nobody serves: moved, then failed
            unserved = store.create_job(request, "o", lambda i: QueueMessage(queue, f"msg {i}", queue))
            store.unserved(unserved.id, queue, to, "gone")
        cursor = 0
        while True:
            cursor, _ = store.drop_stale_attempts(cursor, 100)
            if not cursor:
                break
        check_noted([client])
        PASSED.append("worker")
    finally:
        store.close()


def test_the_parts_and_the_held_parts_pass_what_their_scripts_declare(settings: Settings) -> None:
    settings = settings.model_copy(update={"image_hold_s": 2.0})  # its image part is held
    client = noted(NotedSync, settings.redis_url)
    store = StoreForTests(client, settings)
    api_client = noted(NotedAsync, settings.redis_url)
    request = JobRequest.accept(
        {"parts": [{"type": "text", "prompt": "hi"}, {"type": "image", "prompt": "a"}]}, settings
    )
    queue = settings.keys.model_queue("m")

    async def create() -> Any:
        api = AsyncJobStore(api_client, settings)
        try:
            return await api.create_job(
                request,
                "o",
                lambda i: QueueMessage(queue, f"text {i}", queue),
                None,
                lambda i, held: QueueMessage(settings.keys.queue_media, f"image {i}"),
            )
        finally:
            await api.close()

    try:
        job = asyncio.run(create())
        store.release_held(time.time() + 3600)  # the held image part's bound passed
        text = store.take_job(part_id(job.id, 0), "w", "m")
        store.append_batch([Append(part_id(job.id, 0), text.attempt, _entries(1, 1), 2, 1)])
        check_noted([client, api_client])
        PASSED.append("parts")
    finally:
        store.close()


def test_the_api_stores_pass_what_their_scripts_declare(settings: Settings) -> None:
    client = noted(NotedAsync, settings.redis_url)
    asyncio.run(_api_calls(client, settings))
    check_noted([client])
    PASSED.append("api")


async def _api_calls(client: Any, settings: Settings) -> None:
    jobs, hooks, batches = (
        AsyncJobStore(client, settings),
        AsyncHookStore(client, settings),
        AsyncBatchStore(client, settings),
    )
    k, now = settings.keys, time.time()
    try:
        request = JobRequest.accept(
            {"prompt": "hi", "max_tokens": 4, "webhook": "http://127.0.0.1:9/hook"}, settings
        )
        job = await jobs.create_job(request, "o")
        await jobs.request_cancel(job.id)  # its end records a delivery
        await jobs.put_response(job.id, "{}")
        await jobs.add_watcher(job.id, "t", 5.0, 60)
        await jobs.renew_watchers([("t", job.id)], 5.0, 60)
        await jobs.ghost_watchers({"t": job.id}, 1.0, 60)
        await jobs.watched(job.id, 1.0)
        [due] = await hooks.due(time.time(), 30.0)
        begun = await hooks.begin(due, "token", time.time(), 30.0)
        assert begun is not None
        await hooks.record("token", begun, {**begun.record, "status": "delivered"}, None, time.time())
        await hooks.retry("job", job.id, 1, "o")

        # The ids in their owner's bucket, as the routes and the feeder make them (common/keys.py).
        file_1, file_2, batch_1, batch_2 = (
            k.new_id(p, 4, k.owner_bucket("o")) for p in ("f1-", "f2-", "b1-", "b2-")
        )
        await batches.reserve_upload("o", file_1, 40)
        await batches.append_upload(file_1, ['{"custom_id": "a"}', '{"custom_id": "b"}'])
        file = {
            "id": file_1,
            "owner": "o",
            "bytes": "40",
            "created_at": repr(now),
            "lines": "2",
            "purpose": "batch",
        }
        await batches.commit_file(file)
        fence = await batches.claim_feeder("feeder", 30.0, k.owner_bucket("o"))
        batch = {
            "id": batch_1,
            "status": "validating",
            "owner": "o",
            "created_at": repr(now),
            "completed": "0",
            "failed": "0",
        }
        await batches.create_batch(batch)
        await batches.validated(batch_1, True, 2, 2, [])
        line_job = LineJob(
            new_job_id(k, k.bucket_of(batch_1)),
            0,
            "a",
            JobRequest.accept({"prompt": "hi"}, settings),
            QueueMessage(k.model_queue("m"), "msg", "q"),
        )
        rejected = LineResult(1, "failed", {"error": "no"})
        await batches.feed(batch_1, "o", (0, 2), [line_job], [rejected])
        await batches.resend(line_job.job_id, line_job.message, 0.0)
        await batches.record(batch_1, [LineResult(0, "completed", {"ok": 1}, line_job.job_id)])
        with tempfile.TemporaryDirectory() as spool:  # a page of results moves to an artifact
            to_artifacts = settings.model_copy(update={"artifact_url": f"file://{spool}"})
            assert await AsyncBatchStore(client, to_artifacts).spill(batch_1, 0, fence)
        await batches.batch_counts(["in_progress"])
        await batches.finalizing(batch_1)
        await batches.append_attempt(file_2, fence, 0, ["{}"])
        await batches.commit_attempt(fence, {**file, "id": file_2, "lines": "1"})
        await batches.finish(batch_1, fence, file_2, "", 1, 1)
        await batches.create_batch({**batch, "id": batch_2})
        await batches.end_batch(batch_2, "cancelled")
        await batches.fail_batch(batch_2, [{"message": "stuck"}])
    finally:
        await jobs.close()


def test_every_script_was_checked() -> None:
    """The tests above (run before this one, in file order) checked a call of every script."""
    if len(PASSED) < 4:
        pytest.skip("needs the four tests above to have run and passed")
    assert SEEN == set(names())


@pytest.mark.skipif(shutil.which("luacheck") is None, reason="luacheck is not installed (Debian: lua-check)")
def test_luacheck_finds_nothing() -> None:
    done = subprocess.run(
        ["luacheck", "--no-color", "common/store/lua"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout

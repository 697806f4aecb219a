"""Every command and snippet of the README runs, as written, against one live `spool up`, and
its output is checked against what the README shows next to it.

Each fenced block of README.md is split into its commands (a bash block: one command per line,
``\\`` continuations joined; the ``# ...`` lines right after a command are its sample output). A
spec below matches each command (a regex on its text) and either runs it and checks its output,
or says why it cannot run here (``NOT_RUNNABLE``). ``test_every_readme_command_is_run_or_excused``
fails on a command no spec matches, and on a spec that matches nothing (a README edit left it
behind), so a new README example needs a check before it can land.

The commands run with ``bash -c`` in a scratch directory whose ``scripts`` is the checkout's (the
README's commands run "from the checkout"), with ``http://127.0.0.1:8000`` (and the worker metrics
ports 9400 and 9401) replaced by the stack's, and ``$JOB_ID`` set to the job the README's text
means at that point. The stack is ``spool up`` as a newcomer runs it: the default model, a text, a
media and a hook worker, ``SPOOL_WORKER_METRICS_PORT`` set as the Operations block says, the
eager forward (the compile is the start-up benchmark's subject, not this test's).
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import (
    ROOT,
    SPOOL,
    Service,
    free_port,
    heartbeats,
    http_status,
    spool_env,
    start,
    wait_until,
)

from common.keys import Keys

README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
README_URL = "http://127.0.0.1:8000"
VENV = Path(sys.executable).parent.parent


# -- the README, split into blocks and commands -------------------------------------------------


@dataclass(frozen=True)
class Block:
    lang: str  # "bash", "python", "" (a diagram)
    text: str
    line: int  # where the block starts in README.md


@dataclass
class Command:
    text: str  # the command as bash runs it (its continuation lines, its trailing comment)
    sample: list[str]  # the comment lines right after it: what the README shows it printing
    line: int


def readme_blocks() -> list[Block]:
    readme = README.read_text()
    return [
        Block(m.group(1), m.group(2), readme.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(readme)
    ]


def bash_commands(block: Block) -> list[Command]:
    commands: list[Command] = []
    current: Command | None = None  # the command whose sample the next comment lines are
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        line, number = lines[i], block.line + 1 + i
        i += 1
        if not line.strip():
            current = None  # after a blank line, comments describe the next command
        elif line.startswith("#"):
            if current is not None:
                current.sample.append(line[1:].strip())
        else:
            text = line
            while (text.endswith("\\") or quote_open(text)) and i < len(
                lines
            ):  # a continuation, a quote open
                text += "\n" + lines[i]  # (bash joins a backslash-newline itself)
                i += 1
            current = Command(text, [], number)
            commands.append(current)
    return commands


def quote_open(text: str) -> bool:
    """Whether a quote is open at the end of ``text`` (bash's quoting; a comment ends the scan)."""
    quote = ""
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1].isspace()):
            break
    return bool(quote)


def python_snippets() -> list[Block]:
    return [b for b in readme_blocks() if b.lang == "python"]


def snippet(marker: str) -> Block:
    [block] = [b for b in python_snippets() if marker in b.text]
    return block


# -- the live stack -------------------------------------------------------------------------------


@dataclass
class Stack:
    up: Service
    env: dict[str, str]  # what the commands run with: the stack's SPOOL_PORT, VENV for scripts/spool
    url: str
    metrics_port: int
    work: Path  # the commands' working directory
    state: dict[str, Any] = field(default_factory=dict)  # what one command leaves for the next

    def substitute(self, text: str) -> str:
        port = self.metrics_port
        text = text.replace(README_URL, self.url).replace("/tmp/", f"{self.work}/")  # files it writes
        return text.replace("127.0.0.1:9400", f"127.0.0.1:{port}").replace(
            "127.0.0.1:9401", f"127.0.0.1:{port + 1}"
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def job(self, body: dict[str, Any]) -> str:
        with self.http() as c:
            response = c.post("/v1/jobs", json=body)
            assert response.status_code == 202, response.text
            return str(response.json()["id"])

    def finished(self, job_id: str, timeout: float = 120) -> dict[str, Any]:
        job: dict[str, Any] = {}

        def ended() -> bool:
            with self.http() as c:
                job.update(c.get(f"/v1/jobs/{job_id}").json())
            return job["status"] not in ("queued", "running")

        wait_until(ended, f"job {job_id} to end", timeout, (self.up,))
        return job

    def running(self, job_id: str) -> None:
        def started() -> bool:
            with self.http() as c:
                return bool(c.get(f"/v1/jobs/{job_id}").json()["status"] == "running")

        wait_until(started, f"job {job_id} to run", 120, (self.up,))


@pytest.fixture(scope="module")
def stack(prefixes, tiny_image_model: Path, log_dir: Path, redis_client, tmp_path_factory) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    port, metrics_port = free_port(), free_port(in_a_row=3)  # the text, media and hook workers'
    prefix = prefixes.new()
    # no SPOOL_MODEL: the default model
    env = spool_env(
        prefix, port=port, image_model=tiny_image_model, heartbeat_s=0.5, worker_metrics_port=metrics_port
    )
    up = start(f"readme-up-{prefix}", [SPOOL, "up"], env, log_dir)
    work = tmp_path_factory.mktemp("readme")
    (work / "scripts").symlink_to(ROOT / "scripts")
    stack = Stack(up, {**env, "VENV": str(VENV)}, f"http://127.0.0.1:{port}", metrics_port, work)
    try:
        wait_until(lambda: "spool: ready at" in up.log_tail(), "spool up: ready", 300, (up,))
        # the three kinds (the media worker may come up after "ready"), so every example can run
        wait_until(lambda: len(heartbeats(redis_client, Keys(prefix))) == 3, "every worker", 300, (up,))
        yield stack
    finally:
        up.stop()


@dataclass
class Ran:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def run(stack: Stack, command: str, stdin: str = "", env: dict[str, str] | None = None) -> Ran:
    result = subprocess.run(
        ["bash", "-c", stack.substitute(command)],
        cwd=stack.work,
        env={**stack.env, **(env or {})},
        input=stdin.encode(),
        capture_output=True,  # bytes: text mode would turn curl -i's CRLFs into LFs
        timeout=300,
        check=False,
    )
    return Ran(result.returncode, result.stdout.decode(), result.stderr.decode())


# -- output helpers -------------------------------------------------------------------------------


def http_response(raw: str) -> tuple[int, dict[str, str], str]:
    """curl -i's output: status, headers (lower-cased names), body."""
    head, _, body = raw.partition("\r\n\r\n")
    status_line, *header_lines = head.split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, body


def sse(body: str) -> list[dict[str, Any]]:
    """The events of an SSE body: {"id", "event", "data"} each (data parsed when JSON)."""
    events = []
    for chunk in body.replace("\r\n", "\n").split("\n\n"):
        event: dict[str, Any] = {}
        for line in chunk.splitlines():
            name, _, value = line.partition(":")
            if name in ("id", "event", "data"):
                event[name] = value.strip()
        if "data" in event:
            try:
                event["data"] = json.loads(event["data"])
            except json.JSONDecodeError:
                pass
            events.append(event)
    return events


def sample_events(sample: list[str]) -> list[tuple[str, str]]:
    """(event, data) of a sample that shows events, one per line or as id/event/data lines."""
    found = [(m[1], m[2]) for m in (re.match(r"event: (\w+)\s+data: (.*)", s) for s in sample) if m]
    names = [s.split(": ", 1)[1] for s in sample if s.startswith("event: ")]
    datas = [s.split(": ", 1)[1] for s in sample if s.startswith("data: ")]
    return found or list(zip(names, datas, strict=False))


def sample_keys(data: str) -> set[str]:
    """The top-level keys of a sample JSON object that may hold ``...``."""
    depth, keys = 0, set()
    for m in re.finditer(r'[{}\[\]]|"(\w+)":', data):
        if m.group(0) in "{[":
            depth += 1
        elif m.group(0) in "}]":
            depth -= 1
        elif depth == 1:
            keys.add(m.group(1))
    return keys


def check_sample_events(sample: list[str], events: list[dict[str, Any]]) -> None:
    """Every event the README shows is in the stream, with the fields it shows."""
    shown = sample_events(sample)
    assert shown, sample
    for name, data in shown:
        matching = [e for e in events if e.get("event") == name]
        assert matching, (
            f"the README shows a {name!r} event; the stream had {[e.get('event') for e in events]}"
        )
        keys = sample_keys(data)
        assert any(keys <= set(e["data"]) for e in matching), (name, keys, matching[:2])


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def number_pattern(sample_line: str) -> re.Pattern[str]:
    """A sample line as a regex: its numbers any numbers, an elided word (``3f0c...``) any word."""
    pieces = []
    for piece in re.split(r"(\S*\.\.\.)", sample_line):
        if piece.endswith("..."):
            pieces.append(r"\S+")
        else:
            pieces.extend(
                re.escape(p) if i % 2 == 0 else r"\d+(?:\.\d+)?"
                for i, p in enumerate(re.split(r"(\d+(?:\.\d+)?)", piece))
            )
    return re.compile("".join(pieces))


def consecutive_ids(events: list[dict[str, Any]], first: int = 1) -> None:
    assert [int(e["id"]) for e in events] == list(range(first, first + len(events)))


# -- the checks, one per README command -----------------------------------------------------------


Check = Callable[[Stack, Command], None]


def generate(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text)
    assert ran.rc == 0, ran.err
    [shown] = [s.removesuffix("(on stderr)").strip() for s in cmd.sample]
    [said] = [line for line in ran.err.splitlines() if line.startswith("spool: ")]
    stopped = re.search(r"\(finish reason stop\), (\d+) tokens", said)
    if stopped:  # sampled with no seed: the model may end its text (EOS) before --max-tokens
        assert int(stopped[1]) <= 60, said
        said = said.replace("finish reason stop", "finish reason length")
    else:
        assert "succeeded (finish reason length), 60 tokens in" in said  # --max-tokens 60
    assert number_pattern(shown).fullmatch(said), (shown, said)
    assert ran.out.strip()
    stack.state["generated"] = said.rsplit("job ", 1)[1]


def generate_chat(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text)
    assert ran.rc == 0, ran.err
    assert re.search(r"^spool: succeeded \(finish reason \w+\), \d+ tokens", ran.err, re.M), ran.err


def chat(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text, stdin="Speak, friend.\nAnd then?\n/reset\nHello\n/exit\n")
    assert ran.rc == 0, ran.err
    assert "spool chat: history cleared" in ran.err
    assert ran.out.strip()  # the replies, streamed
    assert ran.err.count("spool: succeeded") == 3, ran.err  # a reply to each of the three messages


def write_prompts(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text)
    assert ran.rc == 0, ran.err
    lines = [json.loads(line) for line in (stack.work / "prompts.jsonl").read_text().splitlines()]
    assert [line["prompt"] for line in lines] == ["ROMEO:", "JULIET:"]


def assigned_job_id(stack: Stack, cmd: Command) -> str:
    """The job id a ``JOB_ID=$(...)`` line sets."""
    ran = run(stack, f'{cmd.text}\necho "$JOB_ID"')
    assert ran.rc == 0 and re.fullmatch(r"[0-9a-f]{32}\n", ran.out), (ran.out, ran.err)
    return ran.out.strip()


def job_id_of_newest(stack: Stack, cmd: Command) -> None:
    newest = stack.http().get("/v1/jobs", params={"limit": 1}).json()["data"][0]["id"]
    assert assigned_job_id(stack, cmd) == newest


def job_id_of_submit(stack: Stack, cmd: Command) -> None:
    job_id = assigned_job_id(stack, cmd)
    assert stack.http().get(f"/v1/jobs/{job_id}").status_code == 200  # a job this submit made


def batch(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text)
    assert ran.rc == 0, ran.err
    output = [json.loads(line) for line in (stack.work / "prompts.output.jsonl").read_text().splitlines()]
    assert len(output) == 2 and {"j"} <= {line["custom_id"] for line in output}, output
    errors = stack.work / "prompts.errors.jsonl"  # written only when a line failed
    assert not errors.exists() or not errors.read_text().strip()
    found = re.search(r"batch_\w+", ran.err + ran.out)
    assert found, ran.err
    stack.state["batch"] = found.group(0)


def batches(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text)
    assert ran.rc == 0, ran.err
    [row] = [line for line in ran.out.splitlines() if stack.state["batch"] in line]
    assert "completed" in row, ran.out


def jobs(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text)
    assert ran.rc == 0, ran.err
    assert stack.state["generated"] in ran.out
    rows = [line for line in ran.out.splitlines()[1:] if line.strip()]
    assert rows and all("succeeded" in row for row in rows), ran.out


def follow(stack: Stack, cmd: Command) -> None:
    job_id = stack.job({"prompt": "ROMEO:", "max_tokens": 24})
    ran = run(stack, cmd.text, env={"JOB_ID": job_id})
    assert ran.rc == 0, ran.err
    assert ran.out.rstrip("\n") == stack.finished(job_id)["text"].rstrip("\n")


def cancel(stack: Stack, cmd: Command) -> None:
    # min_tokens: a sampled job may otherwise meet its end-of-text token before a poll sees it run
    job_id = stack.job({"prompt": "ROMEO:", "max_tokens": 1000, "min_tokens": 1000, "temperature": 0.8})
    stack.running(job_id)
    ran = run(stack, cmd.text, env={"JOB_ID": job_id})
    assert ran.rc == 0, ran.err
    assert stack.finished(job_id)["status"] == "cancelled"
    # "or a batch: scripts/spool cancel batch_...", on a batch whose lines are still running
    body = {"prompt": "ROMEO:", "max_tokens": 1000, "min_tokens": 1000}
    lines = "".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/jobs", "body": body}) + "\n"
        for i in range(4)
    )
    with stack.http() as c:
        file_id = c.post("/v1/files", files={"file": ("b.jsonl", lines)}, data={"purpose": "batch"}).json()[
            "id"
        ]
        made = c.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/jobs", "completion_window": "24h"}
        )
        batch_id = made.json()["id"]
        ran = run(stack, f"scripts/spool cancel {batch_id}")
        assert ran.rc == 0, ran.err
        ended: dict[str, Any] = {}

        def cancelled() -> bool:
            ended.update(c.get(f"/v1/batches/{batch_id}").json())
            return ended["status"] == "cancelled"

        wait_until(cancelled, "the batch cancelled", 120, (stack.up,))


def workers(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text)
    assert ran.rc == 0, ran.err
    header, *rows = ran.out.splitlines()
    assert header.split() == ["KIND", "MODEL", "LOAD"]
    assert sorted(row.split()[0] for row in rows) == ["hooks", "media", "text"]


def version(stack: Stack, cmd: Command) -> None:
    from importlib.metadata import version as installed

    ran = run(stack, cmd.text)
    assert ran.rc == 0, ran.err
    assert ran.out.strip() == f"spool {installed('spool')}"


def submit(stack: Stack, cmd: Command) -> None:
    status, headers, body = http_response(run(stack, cmd.text).out)
    assert status == 202, body
    job = json.loads(body)
    assert headers["location"].endswith(f"/v1/jobs/{job['id']}")
    assert headers["x-spool-ready"] == "true"  # a worker is live
    [shown] = cmd.sample
    assert sample_keys(shown) <= set(job)
    assert job["status"] == "queued" and job["text"] == ""  # as shown
    stack.state["job"] = job["id"]


def idempotent_submit(stack: Stack, cmd: Command) -> None:
    first, again = (http_response(run(stack, cmd.text).out) for _ in range(2))
    assert first[0] == 202 and again[0] in (200, 202), again
    assert json.loads(first[2])["id"] == json.loads(again[2])["id"]  # the job the first one made
    other = run(stack, cmd.text.replace('"max_tokens": 64', '"max_tokens": 65'))  # another body
    assert http_response(other.out)[0] == 409


def poll(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text, env={"JOB_ID": stack.state["job"]})
    job = ran.json()
    assert job["id"] == stack.state["job"]
    assert job["status"] in ("queued", "running", "succeeded") and isinstance(job["text"], str)


def events(stack: Stack, cmd: Command) -> None:
    job_id = stack.state["job"]
    stack.finished(job_id)
    got = sse(run(stack, cmd.text, env={"JOB_ID": job_id}).out)
    consecutive_ids(got)
    check_sample_events(cmd.sample, got)
    assert [e["event"] for e in got] == ["token"] * (len(got) - 1) + ["done"]
    done = got[-1]["data"]
    assert done["status"] == "succeeded" and done["finish_reason"] == "length" and len(got) == 65
    stack.state["events"] = got


def resume(stack: Stack, cmd: Command) -> None:
    got = sse(run(stack, cmd.text, env={"JOB_ID": stack.state["job"]}).out)
    assert got == stack.state["events"][12:]  # from id 13 on


def submit_and_stream(stack: Stack, cmd: Command) -> None:
    status, headers, body = http_response(run(stack, cmd.text).out)
    assert status == 200 and "/v1/jobs/" in headers["location"]
    got = sse(body)
    consecutive_ids(got)
    assert got[-1]["event"] == "done" and got[-1]["data"]["status"] == "succeeded"


def cancel_curl(stack: Stack, cmd: Command) -> None:
    # min_tokens: a sampled job may otherwise meet its end-of-text token before a poll sees it run
    job_id = stack.job({"prompt": "ROMEO:", "max_tokens": 1000, "min_tokens": 1000, "temperature": 0.8})
    stack.running(job_id)
    answer = run(stack, cmd.text, env={"JOB_ID": job_id}).json()
    assert answer["id"] == job_id
    assert stack.finished(job_id)["status"] == "cancelled"
    again = run(stack, cmd.text, env={"JOB_ID": job_id})  # idempotent
    assert again.json()["status"] == "cancelled"
    ended = run(
        stack,
        cmd.text.replace("curl -s", "curl -s -o /dev/null -w '%{http_code}'"),
        env={"JOB_ID": stack.state["job"]},
    )
    assert ended.out == "409"  # a job that already succeeded


def list_jobs(stack: Stack, cmd: Command) -> None:
    page = run(stack, cmd.text).json()
    [shown] = cmd.sample
    assert sample_keys(shown) <= set(page)
    assert page["object"] == "list" and 0 < len(page["data"]) <= 20
    assert all("text" not in job and "usage" in job for job in page["data"])


def wait_result(stack: Stack, cmd: Command) -> None:
    job = run(stack, cmd.text).json()
    assert job["status"] == "succeeded" and job["text"], job


def parts_submit(stack: Stack, cmd: Command) -> None:
    job = run(stack, cmd.text).json()
    assert job["status"] in ("queued", "running") and [p["type"] for p in job["parts"]] == [
        "text",
        "image",
        "image",
    ]
    stack.state["parts_job"] = job["id"]


def parts_events(stack: Stack, cmd: Command) -> None:
    job_id = stack.state["parts_job"]
    got = sse(run(stack, cmd.text, env={"JOB_ID": job_id}).out)
    consecutive_ids(got)
    check_sample_events(cmd.sample, got)
    done = got[-1]
    assert done["event"] == "done" and done["data"]["status"] == "succeeded", done
    images = {
        e["data"]["part"]: e["data"]
        for e in got
        if e["event"] == "part" and e["data"].get("status") == "succeeded" and "width" in e["data"]
    }
    assert (images[1]["width"], images[1]["height"]) == (128, 128) and images[1]["seed"] == 3
    assert (images[2]["width"], images[2]["height"]) == (64, 64)
    assert images[1]["url"] == f"/v1/jobs/{job_id}/parts/1/content"


def parts_content(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text, env={"JOB_ID": stack.state["parts_job"]})
    assert ran.rc == 0, ran.err
    assert png_size((stack.work / "lighthouse.png").read_bytes()) == (128, 128)


def models(stack: Stack, cmd: Command) -> None:
    listed = run(stack, cmd.text).json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["spool-default"]


def completions(stack: Stack, cmd: Command) -> None:
    answer = run(stack, cmd.text).json()
    assert answer["object"] == "text_completion" and answer["choices"][0]["text"], answer
    assert answer["usage"]["completion_tokens"] == 32 or answer["choices"][0]["finish_reason"] == "stop"


def chat_stream(stack: Stack, cmd: Command) -> None:
    status, headers, body = http_response(run(stack, cmd.text).out)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    chunks = [e["data"] for e in sse(body)]
    assert chunks[-1] == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"])
    stack.state["chat_job"] = headers["x-spool-job-id"]
    stack.state["chat_chunks"] = chunks


def chat_resume(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text, env={"JOB_ID": stack.state["chat_job"]})
    chunks = [e["data"] for e in sse(ran.out)]
    assert chunks and chunks[-1] == "[DONE]", ran.out
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert len(chunks) < len(stack.state["chat_chunks"])  # only what came after event 12


def healthz(stack: Stack, cmd: Command) -> None:
    ran = run(stack, cmd.text.split("#")[0] + " -w ' %{http_code}'")
    assert ran.rc == 0 and ran.out.endswith(" 200"), ran.out


def readyz(stack: Stack, cmd: Command) -> None:
    ready = run(stack, cmd.text).json()
    assert ready["status"] == "ready" and len(ready["workers"]) == 3, ready  # "with the live workers"
    assert all("kind" in w for w in ready["workers"]), ready


def api_metrics(stack: Stack, cmd: Command) -> None:
    text = run(stack, cmd.text).out
    # "requests by route and status, ..., queue depth"
    assert 'spool_http_requests_total{method="POST",route="/v1/jobs",status="202"}' in text, text[:400]


def text_worker_metrics(stack: Stack, cmd: Command) -> None:
    text = run(stack, cmd.text).out
    for name in ("spool_time_to_first_token_seconds", "spool_inter_token_latency_seconds"):
        assert name in text, text[:400]


def media_worker_metrics(stack: Stack, cmd: Command) -> None:
    text = run(stack, cmd.text).out
    for name in (
        "spool_image_parts_total",
        "spool_image_denoise_step_seconds",
        "spool_image_queue_time_seconds",
    ):
        assert name in text, text[:400]  # "image parts by status, denoising step time, queue wait"


@dataclass(frozen=True)
class Spec:
    match: str  # a regex searched in the command's text
    check: Check | None = None
    not_runnable: str = ""  # why not, when it does not run here


SPECS = [
    # the set-up: this test runs under scripts/test.sh, and its stack is what serve.sh ends in
    Spec(
        r"^scripts/serve\.sh ", not_runnable="creates .venv and installs; its `spool up` is this test's stack"
    ),
    Spec(r"^scripts/test\.sh ", not_runnable="runs the whole suite, this test included"),
    Spec(r"^SPOOL_MODEL=Qwen/", not_runnable="downloads a hub model and needs CUDA"),
    Spec(r"^SPOOL_IMAGE_MODEL=stabilityai/", not_runnable="downloads a hub pipeline and needs CUDA"),
    Spec(r"^docker compose up", not_runnable="needs Docker and a GPU (the compose file's worker)"),
    Spec(r'^scripts/spool generate "ROMEO:"', generate),
    Spec(r"^echo .* \| scripts/spool generate - --chat", generate_chat),
    Spec(r"^scripts/spool chat ", chat),
    Spec(r"^printf .*> /tmp/prompts\.jsonl$", write_prompts),
    Spec(r"^scripts/spool batch /tmp/prompts\.jsonl", batch),
    Spec(r"^scripts/spool batches ", batches),
    Spec(r"^scripts/spool jobs ", jobs),
    Spec(r"^JOB_ID=\$\(scripts/spool jobs ", job_id_of_newest),
    Spec(r"^scripts/spool job \$JOB_ID --follow", follow),
    Spec(r"^scripts/spool cancel \$JOB_ID", cancel),
    Spec(r"^scripts/spool workers ", workers),
    Spec(r"^scripts/spool --version$", version),
    Spec(r'^curl -si \S+/v1/jobs -H .*\n.*"seed": 7', submit),
    Spec(r"^curl -si \S+/v1/jobs .*\n.*Idempotency-Key", idempotent_submit),
    Spec(r"^JOB_ID=\$\(curl -s \S+/v1/jobs ", job_id_of_submit),
    Spec(r"^curl -s \S+/v1/jobs/\$JOB_ID$", poll),
    Spec(r"^curl -N \S+/v1/jobs/\$JOB_ID/events$", events),  # the Jobs block's (run first)
    Spec(r"^curl -N \S+/v1/jobs/\$JOB_ID/events -H 'Last-Event-ID: 12'$", resume),
    Spec(r"^curl -Ni \S+/v1/jobs .*\n.*\"stream\": true", submit_and_stream),
    Spec(r"^curl -s -X POST \S+/v1/jobs/\$JOB_ID/cancel$", cancel_curl),
    Spec(r"^curl -s '\S+/v1/jobs\?limit=20'$", list_jobs),
    Spec(r"^curl -s \S+/v1/jobs .*\n.*\"background\": false", wait_result),
    Spec(r'^curl -s \S+/v1/jobs .*"parts"', parts_submit),
    Spec(r"^curl -s \S+/v1/jobs/\$JOB_ID/parts/1/content -o /tmp/lighthouse\.png$", parts_content),
    Spec(r"^curl -s \S+/v1/models$", models),
    Spec(r"^curl -s \S+/v1/completions ", completions),
    Spec(r"^curl -iN \S+/v1/chat/completions ", chat_stream),
    Spec(r'^curl -N "\S+/v1/jobs/\$JOB_ID/events\?format=openai"', chat_resume),
    Spec(r"^curl -s \S+/healthz ", healthz),
    Spec(r"^curl -s \S+/readyz ", readyz),
    Spec(r"^curl -s \S+:8000/metrics ", api_metrics),
    Spec(r"^curl -s \S+:9400/metrics ", text_worker_metrics),
    Spec(r"^curl -s \S+:9401/metrics ", media_worker_metrics),
]
# The parts block's events command is the Jobs block's text too; the block tells them apart.
PARTS_EVENTS = Spec(r"^curl -N \S+/v1/jobs/\$JOB_ID/events$", parts_events)


def specs_for(block: Block, cmd: Command) -> list[Spec]:
    specs = [s for s in SPECS if re.search(s.match, cmd.text)]
    if '"parts"' in block.text and specs and specs[0].check is events:
        return [PARTS_EVENTS]
    return specs


# -- python snippets ------------------------------------------------------------------------------


def run_openai_snippets(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    """The OpenAI block, then the images one with its ``client``, then the batch one."""
    client_block, images_block, batch_block = (snippet(m) for m in SNIPPETS[1:])
    namespace: dict[str, Any] = {}
    exec(stack.substitute(client_block.text), namespace)  # noqa: S102 (the README's own code)
    printed = capsys.readouterr().out
    assert printed.strip(), "the completion and the streamed chat reply"
    client = namespace["client"]
    try:
        exec(stack.substitute(images_block.text), namespace)  # noqa: S102
        assert png_size((stack.work / "lighthouse.png").read_bytes()) == (128, 128)

        lines = [
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 4},
            }
            for i in range(2)
        ]  # "A JSONL file of request lines" (the block reads requests.jsonl)
        (stack.work / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        exec(batch_block.text, namespace)  # noqa: S102
    finally:
        client.close()
    out = capsys.readouterr().out
    assert out.startswith("completed "), out
    results = [json.loads(line) for line in out.splitlines()[1:] if line.startswith("{")]
    assert sorted(r["custom_id"] for r in results) == ["r0", "r1"]
    assert all(r["response"]["status_code"] == 200 for r in results)


ENGINE_SNIPPET = "from workers.engine import Engine"
CLIENT_SNIPPET = "client = OpenAI(base_url="
IMAGES_SNIPPET = "client.images.generate("
BATCH_SNIPPET = "client.batches.create("
SNIPPETS = [ENGINE_SNIPPET, CLIENT_SNIPPET, IMAGES_SNIPPET, BATCH_SNIPPET]  # each runs below


def run_engine_snippet(block: Block) -> None:
    """The engine alone, in a process of its own, on the default model and the CPU instead of the
    README's Qwen on CUDA (a download and a GPU): its last line's value printed."""
    from workers.engine.tiny import default_model_path

    code = block.text.replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(str(default_model_path())))
    code = code.replace('device="cuda", dtype="bfloat16"', 'device="cpu", dtype="float32"')
    *body, last = code.strip().splitlines()
    program = "\n".join(["import json", *body, f"print(json.dumps(list(({last}))))"])
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    text, token_ids, finish_reason = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(text, str) and len(token_ids) == 32 and finish_reason == "length"


# -- the tests ------------------------------------------------------------------------------------


def test_every_readme_command_is_run_or_excused() -> None:
    used: set[str] = set()
    unmatched = []
    for block in readme_blocks():
        if block.lang == "bash":
            for cmd in bash_commands(block):
                specs = specs_for(block, cmd)
                if len(specs) != 1:
                    unmatched.append(f"README.md:{cmd.line}: {len(specs)} specs for {cmd.text!r}")
                used.update(s.match for s in specs)
        elif block.lang == "python":
            continue  # below
        elif block.lang == "":
            assert "──" in block.text, f"README.md:{block.line}: a block without a language is a diagram"
        else:
            unmatched.append(f"README.md:{block.line}: a ```{block.lang} block: no runner")
    assert unmatched == []
    assert {s.match for s in SPECS} - used == set(), "specs that match no README command"
    for block in python_snippets():
        markers = [m for m in SNIPPETS if m in block.text]
        assert len(markers) == 1, f"README.md:{block.line}: a python block matches {markers} of SNIPPETS"
    assert sorted(m for b in python_snippets() for m in SNIPPETS if m in b.text) == sorted(SNIPPETS)


def test_engine_snippet_runs() -> None:
    run_engine_snippet(snippet(ENGINE_SNIPPET))


@pytest.mark.slow
@pytest.mark.timeout(900)  # `spool up` and some 35 commands, on a shared 2-core machine
def test_readme_bash_blocks_run_as_written(stack: Stack) -> None:
    ran: list[str] = []
    failed: list[str] = []
    for block in readme_blocks():
        if block.lang != "bash":
            continue
        for cmd in bash_commands(block):
            [spec] = specs_for(block, cmd)
            if spec.check is None:
                assert spec.not_runnable
                continue
            started = time.monotonic()
            try:
                spec.check(stack, cmd)
            except (AssertionError, KeyError, ValueError) as e:  # the next commands run all the same
                failed.append(f"README.md:{cmd.line}: {cmd.text}\n{type(e).__name__}: {e}")
            ran.append(f"{cmd.line}: {time.monotonic() - started:.1f}s")
    assert failed == [], "\n\n".join(failed)
    assert len(ran) >= 30, ran
    assert http_status(stack.url + "/readyz") == 200


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_python_snippets_run_as_written(
    stack: Stack, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(stack.work)
    run_openai_snippets(stack, capsys)


def test_readme_bench_and_script_paths_exist() -> None:
    """The inline commands of the README name files that exist (`bench/*.py`, `scripts/*`)."""
    readme = README.read_text()
    paths = set(re.findall(r"\b((?:bench|scripts|docs|deploy)/[\w./-]+\w)", readme))
    assert paths and [p for p in sorted(paths) if not (ROOT / p).exists()] == []
    for name in re.findall(r"`\.venv/bin/python (bench/\w+\.py)", readme):
        assert (ROOT / name).is_file(), name

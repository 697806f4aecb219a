"""The `spool` client commands as a user drives them: Ctrl-C (SIGINT), stdin, a wrong --url, a
bad batch file, the job commands, and every command's --help."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from greedy import greedy
from procs import SPOOL, Service, free_port, start_api

from common.keys import Keys
from spool_cli.jobs import PAGE_MAX

LONG_PROMPT = "the quick brown fox"  # greedy on the tiny model runs to max_tokens (no EOS)
COMMANDS = (
    "worker",
    "api",
    "up",
    "generate",
    "batch",
    "batches",
    "jobs",
    "job",
    "cancel",
    "workers",
    "chat",
    "queues",
    "tiny-model",
)
JOB_ID = re.compile(r"job ([0-9a-f]{32})")


@pytest.fixture
def env() -> dict[str, str]:
    """This environment, unbuffered: a test reads the lines as they come."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def spool(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SPOOL, *args], check=False, env=env, input=stdin, capture_output=True, text=True, timeout=120
    )


def popen(*args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([SPOOL, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def job_status(url: str, job_id: str) -> str:
    return str(httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()["status"])


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_says_what_it_does_which_settings_and_an_example(
    command: str, env: dict[str, str]
) -> None:
    result = spool(command, "--help", env=env)
    assert result.returncode == 0
    description = result.stdout.split("\n\n")[1]
    assert len(description) > 60, result.stdout  # more than a usage line
    assert "Settings:" in result.stdout
    example = result.stdout.split("example:\n", 1)[1].strip()
    assert example.split()[0] == "spool" or "spool " in example


@pytest.mark.parametrize(
    "args",
    [
        ("generate", "hello"),
        ("batch", "{file}"),
        ("batches",),
        ("jobs",),
        ("job", "0123456789abcdef0123456789abcdef"),
        ("cancel", "0123456789abcdef0123456789abcdef"),
    ],
)
def test_a_wrong_url_fails_at_once_with_one_line_naming_it(
    args: tuple[str, ...], env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    argv = [a.replace("{file}", str(tmp_path / "in.jsonl")) for a in args]
    result = spool(*argv, "--url", url, env=env)  # (it took 45 s of 21 retries before)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"spool: cannot reach the API at {url} ([Errno 111] Connection refused); is it running? (scripts/serve.sh)"
    ]


def test_generate_reads_the_prompt_from_stdin_and_ends_with_one_summary_line(  # type: ignore[no-untyped-def]
    cluster, tiny_model: Path, env: dict[str, str]
) -> None:
    result = spool(
        "generate",
        "-",
        "--max-tokens",
        "9",
        "--temperature",
        "0",
        "--url",
        cluster.url,
        env=env,
        stdin="hello",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy(tiny_model, "hello", 9).text + "\n"
    [line] = result.stderr.splitlines()
    assert re.fullmatch(
        r"spool: succeeded \(finish reason length\), 9 tokens in \d+\.\d s \(\d+\.\d tok/s\) "
        r"after \d+\.\d s in the queue, job [0-9a-f]{32}",
        line,
    ), line


def test_generate_sends_the_sampling_options_and_chat_messages(  # type: ignore[no-untyped-def]
    cluster, prefixes, env: dict[str, str]
) -> None:
    argv = [
        "generate",
        "Speak.",
        "--system",
        "Be terse.",
        "--max-tokens",
        "5",
        "--seed",
        "7",
        "--top-p",
        "0.9",
    ]
    argv += ["--top-k", "20", "--stop", "zz", "--stop", "yy", "--url", cluster.url]
    result = spool(*argv, env=env)
    assert result.returncode == 0, result.stderr
    [job_id] = JOB_ID.findall(result.stderr)
    request = json.loads(prefixes.client.hget(Keys(cluster.prefix).job(job_id), "request"))
    assert request["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Speak."},
    ]
    assert (request["seed"], request["top_p"], request["top_k"], request["stop"]) == (
        7,
        0.9,
        20,
        ["zz", "yy"],
    )
    chat = spool("generate", "Speak.", "--chat", "--max-tokens", "3", "--url", cluster.url, env=env)
    [chat_id] = JOB_ID.findall(chat.stderr)
    request = json.loads(prefixes.client.hget(Keys(cluster.prefix).job(chat_id), "request"))
    assert request["messages"] == [{"role": "user", "content": "Speak."}] and request["prompt"] is None


def test_ctrl_c_leaves_the_job_running_and_says_how_to_resume_and_cancel_it(  # type: ignore[no-untyped-def]
    cluster, tiny_model: Path, env: dict[str, str]
) -> None:
    proc = popen(
        "generate", LONG_PROMPT, "--max-tokens", "400", "--temperature", "0", "--url", cluster.url, env=env
    )
    assert proc.stdout is not None
    os.read(proc.stdout.fileno(), 1)  # a token is on the terminal: the stream is open
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    [job_id] = set(JOB_ID.findall(err.decode()))
    assert f"spool job {job_id} --follow" in err.decode() and f"spool cancel {job_id}" in err.decode()
    resumed = spool("job", job_id, "--follow", "--url", cluster.url, env=env)  # the job ran on
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == greedy(tiny_model, LONG_PROMPT, 400).text + "\n"
    assert job_status(cluster.url, job_id) == "succeeded"


def test_a_second_ctrl_c_cancels_the_job(bare_api: Service, env: dict[str, str]) -> None:
    """No worker on the bare API's prefix: the job stays queued until the second Ctrl-C."""
    proc = popen("generate", "wait for me", "--url", bare_api.url, env=env)
    assert proc.stderr is not None
    first = proc.stderr.readline().decode()  # "no worker is running: job ... waits in the queue"
    [job_id] = JOB_ID.findall(first)
    proc.send_signal(signal.SIGINT)
    assert "interrupted" in proc.stderr.readline().decode()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert f"job {job_id}: cancel requested" in err.decode()
    assert job_status(bare_api.url, job_id) == "cancelled"


def listed(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """`spool jobs`'s rows by job id, in its order (newest first)."""
    assert result.returncode == 0, result.stderr
    if not result.stdout:  # no jobs: no table, a line on stderr
        assert result.stderr.startswith("spool: no ") and result.stderr.endswith("jobs\n"), result.stderr
        return {}
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["JOB", "STATUS", "TOKENS", "CREATED", "MODEL"]
    return {row.split()[0]: row for row in rows}


def test_jobs_lists_any_clients_jobs_and_job_and_cancel_act_on_one(  # type: ignore[no-untyped-def]
    cluster, bare_api: Service, env: dict[str, str]
) -> None:
    done = spool("generate", "listed", "--max-tokens", "3", "--url", cluster.url, env=env)
    [done_id] = JOB_ID.findall(done.stderr)
    body = {"prompt": "not by spool", "max_tokens": 2, "background": False}  # answers once it ended
    posted = httpx.post(f"{cluster.url}/v1/jobs", json=body, timeout=60).json()
    rows = listed(spool("jobs", "--url", cluster.url, env=env))
    assert list(rows).index(posted["id"]) < list(rows).index(done_id)  # newest first
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(posted["created_at"]))
    assert rows[posted["id"]].split()[1:5] == ["succeeded", "2", *when.split()]
    assert rows[posted["id"]].endswith(posted["model"]) and rows[done_id].split()[1:3] == ["succeeded", "3"]
    assert list(listed(spool("jobs", "--limit", "1", "--url", cluster.url, env=env))) == [posted["id"]]

    shown = spool("job", done_id, "--url", cluster.url, env=env)
    assert json.loads(shown.stdout)["id"] == done_id
    queued = httpx.post(f"{bare_api.url}/v1/jobs", json={"prompt": "x"}).json()["id"]
    waiting = listed(spool("jobs", "--status", "queued", "--url", bare_api.url, env=env))
    assert waiting[queued].split()[-1] == "-"  # no worker took it: no model yet
    cancelled = spool("cancel", queued, done_id, "--url", bare_api.url, env=env)
    assert job_status(bare_api.url, queued) == "cancelled"
    assert cancelled.returncode == 1 and "No job with id" in cancelled.stderr  # done_id: another prefix
    assert queued in listed(spool("jobs", "--status", "cancelled", "--url", bare_api.url, env=env))
    assert queued not in listed(spool("jobs", "--status", "queued", "--url", bare_api.url, env=env))


def test_jobs_into_a_reader_that_went_away_exits_quietly(bare_api: Service, env: dict[str, str]) -> None:
    """`spool jobs | head`: head exits after its lines, and spool's next write meets a closed pipe."""
    httpx.post(f"{bare_api.url}/v1/jobs", json={"prompt": "x"}, timeout=30).raise_for_status()
    listing = subprocess.Popen(
        [SPOOL, "jobs", "--url", bare_api.url], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert listing.stdout is not None and listing.stderr is not None
    listing.stdout.close()  # the reader is gone before the first line
    err = listing.stderr.read().decode()
    assert listing.wait(60) == 141  # as a shell's command that SIGPIPE ended
    assert err == ""


def test_jobs_pages_past_one_answer_and_lists_only_the_keys_own(  # type: ignore[no-untyped-def]
    prefixes, log_dir: Path, env: dict[str, str]
) -> None:
    """More jobs than one GET /v1/jobs answers with, under SPOOL_API_KEYS (no worker: they stay queued)."""
    api = start_api(prefixes.new(), log_dir, ready=False, api_keys="key-one,key-two")
    try:
        with httpx.Client(base_url=api.url, timeout=30) as http:

            def submit(key: str) -> str:
                r = http.post("/v1/jobs", json={"prompt": "p"}, headers={"Authorization": f"Bearer {key}"})
                return str(r.json()["id"])

            mine = [submit("key-one") for _ in range(PAGE_MAX + 5)]
            submit("key-two")
        every = spool("jobs", "--limit", "1000", "--api-key", "key-one", "--url", api.url, env=env)
        assert list(listed(every)) == mine[::-1]  # two pages, none of key-two's
        cut = spool("jobs", "--limit", str(PAGE_MAX + 2), "--api-key", "key-one", "--url", api.url, env=env)
        assert list(listed(cut)) == mine[::-1][: PAGE_MAX + 2]
        refused = spool("jobs", "--url", api.url, env=env)
        assert refused.returncode == 1 and "invalid API key" in refused.stderr
        from_env = spool("jobs", "--limit", "3", "--url", api.url, env={**env, "SPOOL_API_KEY": "key-one"})
        assert list(listed(from_env)) == mine[::-1][:3]  # SPOOL_API_KEY: the default --api-key
        flag_wins = spool(
            "jobs", "--api-key", "key-one", "--url", api.url, env={**env, "SPOOL_API_KEY": "key-two"}
        )
        assert list(listed(flag_wins))[0] == mine[-1]
    finally:
        api.stop()


def test_batch_with_a_bad_line_names_it_and_submits_nothing(
    bare_api: Service, env: dict[str, str], tmp_path: Path, prefixes
) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "fine"}\n\n{"prompt": "broken"\n[1, 2]\n')
    queued = Keys(bare_api.prefix).queued_jobs(0)
    before = prefixes.client.zcard(queued)
    result = spool("batch", str(src), "--url", bare_api.url, env=env)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"spool: {src} line 3: not JSON") and "nothing submitted" in result.stderr
    assert prefixes.client.zcard(queued) == before
    missing = spool("batch", str(tmp_path / "nope.jsonl"), "--url", bare_api.url, env=env)
    assert (missing.returncode, missing.stderr) == (1, f"spool: no such file: {tmp_path / 'nope.jsonl'}\n")


def test_ctrl_c_in_batch_leaves_the_batch_running_and_a_second_one_cancels_it(
    bare_api: Service, env: dict[str, str], tmp_path: Path
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"b{i}", "custom_id": f"c{i}"}) + "\n" for i in range(3)))
    batch_ids = []
    for presses in (1, 2):
        proc = popen("batch", str(src), "--url", bare_api.url, env=env)
        assert proc.stderr is not None
        first = proc.stderr.readline().decode()  # "batch ID (resume with: ...)": it exists on the server
        [batch_id] = set(re.findall(r"batch_[0-9a-f]{32}", first))
        proc.send_signal(signal.SIGINT)
        told = ""
        while "interrupted" not in told:  # the hint: a second Ctrl-C now cancels the batch
            told = proc.stderr.readline().decode()
            assert told, "the command ended without its hint"
        assert f"spool batch --resume {batch_id}" in told
        if presses == 2:
            proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
        assert proc.returncode == 130
        batch_ids.append(batch_id)
    statuses = [httpx.get(f"{bare_api.url}/v1/batches/{b}").json()["status"] for b in batch_ids]
    assert statuses[0] in ("validating", "in_progress")  # no worker: its lines wait
    assert statuses[1] in ("cancelling", "cancelled")


def test_cancel_takes_a_batch_id_and_cancels_the_batch(
    bare_api: Service, env: dict[str, str], tmp_path: Path
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"b{i}"}) + "\n" for i in range(2)))
    proc = popen("batch", str(src), "--url", bare_api.url, env=env)
    assert proc.stderr is not None
    [batch_id] = set(re.findall(r"batch_[0-9a-f]{32}", proc.stderr.readline().decode()))
    proc.send_signal(signal.SIGINT)  # the command stops; the batch waits for a worker
    proc.communicate(timeout=30)
    result = spool("cancel", batch_id, "--url", bare_api.url, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"spool: batch {batch_id}: cancel requested")
    status = httpx.get(f"{bare_api.url}/v1/batches/{batch_id}").json()["status"]
    assert status in ("cancelling", "cancelled")


def test_version(env: dict[str, str]) -> None:
    result = spool("--version", env=env)
    assert result.returncode == 0 and re.fullmatch(r"spool \d+\.\d+\.\d+\S*\n", result.stdout), result.stdout

"""``spool jobs``, ``job``, ``cancel`` and ``workers``: a running API's jobs and workers, listed,
shown or cancelled (httpx, no torch)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from spool_cli.client import MAX_RECONNECTS, RETRY_STATUSES, Api, back_off, error_text, say

PAGE_MAX = 100  # the most jobs one GET /v1/jobs answers with (its `limit`)
BATCH_ID_PREFIX = "batch_"  # `spool cancel` cancels these as batches


def get_job(api: Api, job_id: str) -> tuple[dict[str, Any] | None, str | None]:
    """(job, None), or (None, the API's refusal): one try, an unreachable API raises."""
    try:
        resp = api.http.get(f"/v1/jobs/{job_id}")
    except httpx.TransportError as e:
        api.lost(e)
        return None, f"connection lost ({e})"
    if resp.is_error:
        return None, error_text(resp)
    job: dict[str, Any] = resp.json()
    return job, None


def show_job(url: str, job_id: str, api_key: str | None) -> int:
    with Api(url, api_key) as api:
        job, error = get_job(api, job_id)
    if job is None:
        say(str(error))
        return 1
    print(json.dumps(job, indent=2, ensure_ascii=False))
    return 0


def cancel_jobs(url: str, job_ids: list[str], api_key: str | None) -> int:
    with Api(url, api_key) as api:
        return cancel(api, job_ids)


def cancel(api: Api, job_ids: list[str]) -> int:
    """Cancel each job (a batch_... id: the batch); the exit code. A job that already ended is
    said, not an error."""
    code = 0
    for job_id in job_ids:
        if job_id.startswith(BATCH_ID_PREFIX):
            code = _cancel_batch(api, job_id) or code
            continue
        try:
            resp = api.http.post(f"/v1/jobs/{job_id}/cancel")
        except httpx.TransportError as e:
            api.lost(e)
            say(f"job {job_id}: connection lost ({e}); not cancelled")
            code = 1
            continue
        if resp.status_code == 409:
            say(f"job {job_id}: {error_text(resp)}")
        elif resp.is_error:
            say(f"job {job_id}: {error_text(resp)}")
            code = 1
        else:
            say(f"job {job_id}: cancel requested (its status now: {resp.json()['status']})")
    return code


def _cancel_batch(api: Api, batch_id: str) -> int:
    try:
        resp = api.http.post(f"/v1/batches/{batch_id}/cancel")
    except httpx.TransportError as e:
        api.lost(e)
        say(f"batch {batch_id}: connection lost ({e}); not cancelled")
        return 1
    if resp.is_error:
        say(f"batch {batch_id}: {error_text(resp)}")
        return 0 if resp.status_code == 409 else 1
    say(f"batch {batch_id}: cancel requested (its status now: {resp.json()['status']})")
    return 0


def list_workers(url: str, api_key: str | None) -> int:
    """The live workers (GET /console-status), one line each: kind, model, load."""
    with Api(url, api_key) as api:
        try:
            resp = api.http.get("/console-status")
        except httpx.TransportError as e:
            api.lost(e)
            say(f"connection lost ({e})")
            return 1
    if resp.is_error:
        say(error_text(resp))
        return 1
    workers = sorted(resp.json()["workers"], key=lambda w: (w.get("kind", ""), w.get("model", "")))
    if not workers:
        say("no live worker")
        return 0
    print(f"{'KIND':5}  {'MODEL':40}  LOAD")
    for w in workers:
        model = w.get("model") or "-"  # a hook worker serves no model
        print(f"{w.get('kind', 'text'):5}  {model:40}  {_load(w.get('engine') or {})}")
    return 0


def _load(engine: dict[str, Any]) -> str:
    """A worker's load, from its heartbeat's engine figures."""
    if "slots" in engine:  # a text worker's engine stats
        return f"{engine['running']} running of {engine['slots']} slots, {engine['waiting']} waiting"
    if "step" in engine:  # a media worker with a part
        return f"1 image part, step {engine['step']} of {engine['steps']}"
    return f"{engine.get('running', 0)} running"


def list_jobs(url: str, limit: int, status: str | None, api_key: str | None) -> int:
    """The newest ``limit`` jobs of the API key (without keys: every job), whichever client
    submitted them, as a table; ``status``: only jobs in that state."""
    with Api(url, api_key) as api:
        jobs, error = _listed(api, limit, status)
    if jobs:
        print(f"{'JOB':32}  {'STATUS':9}  {'TOKENS':>6}  {'CREATED':19}  MODEL")
        for job in jobs:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["created_at"]))
            tokens = job["usage"]["completion_tokens"]
            print(f"{job['id']:32}  {job['status']:9}  {tokens:>6}  {when:19}  {job['model'] or '-'}")
    if error is not None:
        say(error)
        return 1
    if not jobs:
        say(f"no {status} jobs" if status else "no jobs")
    return 0


def _listed(api: Api, limit: int, status: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """(up to ``limit`` jobs, newest first; None or the error that ended the listing early):
    page after page, each from the last one's ``last_id``. A page may be short and still have
    more (the API reads a bounded part of the index per page), so ``has_more`` decides."""
    jobs: list[dict[str, Any]] = []
    params: dict[str, Any] = {"status": status} if status else {}
    while len(jobs) < limit:
        params["limit"] = min(limit - len(jobs), PAGE_MAX)
        page, error = _page(api, params)
        if page is None:
            return jobs, error
        jobs += page["data"]
        if not page["has_more"]:
            break
        params["after"] = page["last_id"]
    return jobs, None


def _page(api: Api, params: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(one page of GET /v1/jobs, None) or (None, the error); a lost connection or a 502, 503 or
    504 is tried again with back-off, up to ``MAX_RECONNECTS`` times."""
    failures = 0
    while True:
        try:
            resp = api.http.get("/v1/jobs", params=params)
        except httpx.TransportError as e:
            api.lost(e)
            error = f"connection lost ({e})"
        else:
            if resp.status_code not in RETRY_STATUSES:
                return (None, error_text(resp)) if resp.is_error else (resp.json(), None)
            error = error_text(resp)
        failures += 1
        if failures > MAX_RECONNECTS:
            return None, error
        back_off(failures)

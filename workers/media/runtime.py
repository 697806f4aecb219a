"""The media worker's runtime: one image part at a time, through the job store, with the liveness
every worker has (workers/liveness.py).

A Celery task thread calls ``run_part``. It takes the part (a new attempt) and runs the pipeline
from step 0. After every step it appends a ``progress`` event (and a ``preview`` where the part
asks for ``partial_images``), one fenced round trip each, so a worker that was taken over stops
at its next step. One append ends the part with its ``part`` event, its PNG and its status. A
cancel or the part's timeout stops the pipeline at the next step, so the worker is free at once.

An image part of a job with text parts is held until they have their first tokens, or until its
bound, which a ``_release_held`` thread watches. The contract:
docs/internals.md#parts-jobs-of-text-and-image-parts.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from redis.exceptions import RedisError

from common.keys import split_part_id
from common.process import NamedThread
from common.schemas.events import LogEntry
from common.schemas.requests import ImagePart
from common.schemas.views import JobError, JobStatus
from common.settings import Settings
from common.store import Append, Final, SyncJobStore, TakeStatus
from workers.liveness import HeldJob, Liveness, too_many_attempts
from workers.media.metrics import MediaMetrics
from workers.media.pipeline import Image, ImagePipeline, ImageSpec, preview_steps
from workers.media.tiny import default_image_model_path
from workers.publisher import Publisher
from workers.reaper import Requeue
from workers.task_common import Outcome
from workers.watchdog import Watchdog

log = logging.getLogger(__name__)

# NOTE: a held part's message is sent by the script that writes its text parts' first token, before
# its client has it: the API's hub and relay still carry it (a few ms). The part is taken this
# much later, so the image's start does not take the CPU from that relay: on 2 shared cores,
# starting at the token's write still added +17% and +41% to the text part's TTFT at its client;
# 30 to 50 ms more brought it within the noise (docs/benchmarks.md "Media", the image hold).
TOKEN_DELIVERY_S = 0.03


@dataclass
class _Part:
    """The part this worker runs."""

    part_id: str
    index: int
    attempt: int
    created_at: float
    deadline: float | None  # created_at + timeout_s
    next_seq: int  # the part's own count of events + 1 (earlier attempts' included)
    foreground: bool = False  # its job's: aborted (the job cancelled) once nobody watches it
    previewed: frozenset[int] = frozenset()  # steps whose preview an earlier attempt sent
    aborted: bool = False  # a cancel, or its lease lost: stop at the next step
    timed_out: bool = False
    lost: bool = False  # an append was refused: another worker runs it now
    taken_at: float = 0.0  # unix seconds
    begun_at: float = 0.0  # unix seconds: its pipeline called
    step: int = 0  # denoising steps done (its last progress event's), for the heartbeat
    steps: int = 0  # of the part's request

    def seq(self) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq


def content_url(job_id: str, index: int) -> str:
    return f"/v1/jobs/{job_id}/parts/{index}/content"


class MediaRuntime:
    def __init__(
        self,
        pipeline: ImagePipeline,
        store: SyncJobStore,
        settings: Settings,
        name: str,
        model: str,
        requeue: Requeue | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.store = store
        self.name = name  # heartbeat key and the part hash's `worker`
        self.model = model
        # How long the bound's thread sleeps with no part held. A part held just after a check is
        # due SPOOL_IMAGE_HOLD_S later. It sleeps a heartbeat at most, since the API's setting
        # may differ.
        hold_s = settings.image_hold_s
        self._idle_s = min(hold_s, settings.heartbeat_s) if hold_s > 0 else settings.heartbeat_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _part: the task thread sets it, liveness reads it
        self._part: _Part | None = None
        self._images = 0
        self._publisher = Publisher(store, self._stop)
        queue = settings.keys.queue_media
        self.liveness = Liveness(store, settings, name, self, self._stop, requeue, queue)
        self.metrics = MediaMetrics(model)
        # A pipeline step past SPOOL_ENGINE_STALL_S ends the process, as an engine step does.
        self._watchdog = Watchdog(settings.engine_stall_s, self._stop, self.liveness.forget_heartbeat)
        self._step_started = 0.0  # perf_counter at the start of the running denoising step
        self._releaser = NamedThread(target=self._release_held, name="spool-held-parts", daemon=True)

    @classmethod
    def from_settings(cls, settings: Settings, name: str, requeue: Requeue | None = None) -> MediaRuntime:
        """Load the pipeline (the tiny one by default), beat once and start liveness."""
        if settings.torch_threads is not None:
            torch.set_num_threads(settings.torch_threads)  # before the pipeline's first op
        model = settings.image_model or str(default_image_model_path())
        pipeline = ImagePipeline(model, settings.image_device, settings.image_dtype)
        store = SyncJobStore.from_settings(settings)
        runtime = cls(pipeline, store, settings, name, settings.image_model or "spool-tiny-image", requeue)
        if settings.worker_metrics_port is not None:
            runtime.metrics.serve(settings.worker_metrics_port)
        runtime.liveness.start()
        runtime._watchdog.start()
        runtime._releaser.start()
        return runtime

    def close(self) -> None:
        self._stop.set()  # a part running stops at its next step, released (its lease lapses)
        self.liveness.join(timeout=10)
        self._watchdog.join(timeout=10)
        if self._releaser.is_alive():
            self._releaser.join(timeout=10)
        self.store.close()

    def _release_held(self) -> None:
        """The hold's bound: send the held parts due (``SyncJobStore.release_held``), then sleep
        until the next one is (every media worker runs one; the script sends each part once)."""
        wait = 0.0
        while not self._stop.wait(wait):
            try:
                nxt = self.store.release_held(time.time())
            except RedisError as e:  # the next check sends them
                log.warning("could not send the held image parts due: %s", e)
                nxt = None
            wait = self._idle_s if nxt is None else min(max(nxt - time.time(), 0.0), self._idle_s)

    # -- the executor of workers/liveness.py ------------------------------------------------------

    def held(self) -> dict[str, HeldJob]:
        with self._lock:
            p = self._part
            return {p.part_id: HeldJob(p.attempt, p.foreground and not p.aborted)} if p else {}

    def abort(self, job_id: str) -> None:
        with self._lock:
            if self._part is not None and self._part.part_id == job_id:
                self._part.aborted = True

    def heartbeat_fields(self) -> dict[str, Any]:
        """``engine``: ``running`` (0 or 1 part), ``images`` (made since the start) and, while a
        part runs, its id and its denoising ``step`` of ``steps`` (the console shows them)."""
        with self._lock:
            p = self._part
            engine: dict[str, Any] = {"running": int(p is not None), "images": self._images}
            if p is not None:
                engine |= {"part": p.part_id, "step": p.step, "steps": p.steps}
        return {"engine": engine, "model": self.model, "kind": "media"}

    # -- task threads ----------------------------------------------------------------------------

    def run_part(self, part_id: str, held: bool = False) -> Outcome:
        """Take the part, run it, and return once its end is written (or it was lost). ``held``:
        its message was sent at its job's text parts' first tokens (``TOKEN_DELIVERY_S``)."""
        if held:
            self._stop.wait(TOKEN_DELIVERY_S)
        if self._stop.is_set():
            return Outcome.SHUTDOWN
        taken = self.store.take_job(part_id, self.name, self.model)
        if taken.status is TakeStatus.BUSY:
            return Outcome.BUSY
        if taken.status is not TakeStatus.TAKEN or taken.record is None:
            return Outcome.SKIPPED
        split = split_part_id(part_id)
        assert split is not None and isinstance(taken.record.request, ImagePart)
        request, created = taken.record.request, taken.record.job.created_at
        part = _Part(
            part_id,
            split[1],
            taken.attempt,
            created,
            created + request.timeout_s if request.timeout_s else None,
            len(taken.log) + 1,
            foreground=taken.record.foreground_parent,
            previewed=frozenset(e.data["step"] for e in taken.log if e.type == "preview"),
            aborted=taken.record.cancel_requested,
            taken_at=time.time(),
            steps=request.steps,
        )
        self.metrics.taken(created, taken.attempt, part.taken_at)
        if taken.record.released_at is not None and taken.attempt == 1:
            self.metrics.held(taken.record.released_at - created)
        with self._lock:
            self._part = part
        try:
            outcome = self._run(part, split[0], request)
        finally:
            with self._lock:
                self._part = None
        if outcome is not Outcome.FINISHED:
            self.metrics.left()
        return outcome

    def _run(self, part: _Part, job_id: str, request: ImagePart) -> Outcome:
        if (ended := self._ended_before_start(part, request)) is not None:
            return ended
        part.begun_at = time.time()
        prompt = request.prompt if request.prompt is not None else self._prompt_from(job_id, request)
        seed = request.seed if request.seed is not None else default_seed(part.part_id)
        wanted = preview_steps(request.steps, request.partial_images)
        spec = ImageSpec(
            prompt,
            request.width,
            request.height,
            request.steps,
            seed,
            request.guidance_scale,
            request.negative_prompt,
            # A takeover makes the image the first attempt would have (the same seed): the
            # previews it sent are not sent again, and the others keep their index.
            wanted - part.previewed,
        )
        previews = sorted(wanted)
        self._begin_step()
        try:
            image = self.pipeline.generate(
                spec, lambda step, steps, preview: self._progress(part, step, steps, preview, previews)
            )
        except Exception as e:
            self._watchdog.end()
            log.exception("the pipeline failed on part %s", part.part_id)
            return self._fail(part, JobError(message=f"the image pipeline failed: {e}", type="engine_error"))
        self._watchdog.end()  # the last step's decode is done too
        if part.lost:
            return Outcome.LOST
        if image is None and not part.timed_out and not part.aborted:
            return Outcome.SHUTDOWN  # stopped by the worker's stop: another worker runs it again
        if image is None:
            if part.timed_out:
                return self._fail(part, timeout_error(request))
            return self._end(part, JobStatus.CANCELLED, {})
        self._images += 1
        return self._succeed(part, job_id, seed, image)

    def _ended_before_start(self, part: _Part, request: ImagePart) -> Outcome | None:
        """End a part cancelled, out of time or out of attempts before its first step; None: run it."""
        if not part.aborted and not self._in_time(part):
            return self._fail(part, timeout_error(request))
        if (
            not part.aborted
            and (error := too_many_attempts(part.attempt, self.liveness.settings)) is not None
        ):
            return self._fail(part, error)
        if part.aborted:
            return self._end(part, JobStatus.CANCELLED, {})
        return None

    def _prompt_from(self, job_id: str, request: ImagePart) -> str:
        assert request.prompt_from is not None
        # Its message was sent once the text part succeeded (part_append.lua): the text is final.
        return self.store.part_text(job_id, request.prompt_from)

    def _in_time(self, part: _Part) -> bool:
        return part.deadline is None or time.time() < part.deadline

    def _progress(
        self, part: _Part, step: int, steps: int, preview: Image | None, previews: list[int]
    ) -> bool:
        """After each denoising step: its event (and its preview's), or stop (cancelled, timed
        out, taken over). Between two steps the watchdog and the step timer are off: a write to
        an unreachable Redis is no stall of the pipeline."""
        self._watchdog.end()
        self.metrics.step(time.perf_counter() - self._step_started)
        go_on = self._record_step(part, step, steps, preview, previews)
        if go_on:
            self._begin_step()
        return go_on

    def _begin_step(self) -> None:
        self._step_started = time.perf_counter()
        self._watchdog.begin()

    def _record_step(
        self, part: _Part, step: int, steps: int, preview: Image | None, previews: list[int]
    ) -> bool:
        if part.aborted or self._stop.is_set():
            return False
        if not self._in_time(part):
            part.timed_out = True
            return False
        part.step = step
        entries = [LogEntry.progress(part.seq(), part.index, step, steps)]
        if preview is not None:
            index = previews.index(step) if step in previews else len(previews)
            p = preview
            entries.append(LogEntry.preview(part.seq(), part.index, step, index, p.png, p.width, p.height))
        if not self._send(part, Append(part.part_id, part.attempt, entries, 0, 0)):
            part.lost = True
            return False
        return True

    def _succeed(self, part: _Part, job_id: str, seed: int, image: Image) -> Outcome:
        result = {
            "url": content_url(job_id, part.index),
            "content_type": "image/png",
            "width": image.width,
            "height": image.height,
            "seed": seed,
        }
        return self._end(part, JobStatus.SUCCEEDED, result, image.png)

    def _fail(self, part: _Part, error: JobError) -> Outcome:
        return self._end(part, JobStatus.FAILED, {"error": error.model_dump()}, error=error)

    def _end(
        self,
        part: _Part,
        status: JobStatus,
        result: dict[str, Any],
        png: bytes = b"",
        error: JobError | None = None,
    ) -> Outcome:
        entry = LogEntry.part_status(part.seq(), {"part": part.index, "status": status.value, **result})
        final = Final(status, None, error)
        ok = self._send(part, Append(part.part_id, part.attempt, [entry], 0, 0, final, png))
        if ok:
            self.metrics.ended(status.value, part.created_at, part.begun_at or part.taken_at, time.time())
        return Outcome.FINISHED if ok else Outcome.LOST

    def _send(self, part: _Part, append: Append) -> bool:
        """Write ``append``, and say False when it was refused. Either another worker took the
        part over, or one of this worker's writes was lost (a gap) and the part is handed back,
        its lease lapsed for the sweep."""
        sent = self._publisher.send([append])
        if part.part_id in sent.gaps - sent.lost:
            log.error(
                "part %s: its events have a gap before this worker's next one; handing it back", part.part_id
            )
            with self.liveness.leases:  # let go of it first: no beat renews the lease it lapses
                with self._lock:
                    self._part = None
                try:
                    self.store.lapse_leases({part.part_id: part.attempt})
                except RedisError as e:  # its lease then lapses unrenewed
                    log.warning("could not lapse the lease of %s: %s", part.part_id, e)
        return part.part_id not in sent.lost | sent.gaps


def default_seed(part_id: str) -> int:
    """A part's seed when it gives none: from its id (random, 128 bits), so every part differs
    and a part taken over after a crash makes the image the first attempt would have."""
    return int(hashlib.sha256(part_id.encode()).hexdigest()[:15], 16)


def timeout_error(request: ImagePart) -> JobError:
    return JobError(message=f"the image part ran past its timeout_s ({request.timeout_s}s)", type="timeout")

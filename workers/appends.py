"""Turns engine steps' deltas into job log entries: the writes (``Append``) of a text job's
tokens and terminal event, one per job and step; workers/publisher.py sends them.

The log entries and the choices:
docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix and
docs/internals.md#choices-n--1-workersjobpy-workerscorepy-workersappendspy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common.schemas.events import DoneEvent, ErrorEvent, LogEntry, TokenLogprob, TopLogprob
from common.schemas.views import JobError, JobStatus, Usage
from common.store import TEXT_CHECKPOINT_EVENTS, Append, Final, token_entry
from workers.engine import Delta, FinishReason
from workers.engine.types import Logprob, TokenLogprobs


@dataclass
class JobCursor:
    """What the worker must remember to append a job's next events."""

    job_id: str
    attempt: int  # fencing token from take_job
    next_seq: int  # seq of the next log entry (LLEN + 1 when the job was taken)
    next_index: int  # index of the next token event
    prompt_tokens: int = 0
    completion_tokens: int = 0  # resumed tokens included
    error: JobError | None = None  # why the runtime aborted the job (timeout, too long): it fails with it
    # A job with n > 1 choices (docs/internals.md, "Choices"); all empty for n = 1.
    choice_of: dict[str, int] = field(default_factory=dict)  # engine request id -> its choice
    generated: dict[int, int] = field(default_factory=dict)  # choice -> its tokens (resumed included)
    live: set[int] = field(default_factory=set)  # choices whose last event is not written yet
    reasons: dict[int, str] = field(default_factory=dict)  # choice -> why it ended
    ending: Delta | None = None  # the first choice that failed (else was cancelled): the job's end
    ended: bool = False  # the terminal event is built
    # Since the last checkpoint of the text key (Append.checkpoint): the events and their text.
    unsaved: int = 0
    unsaved_text: str = ""

    def next(self) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq


def _final(delta: Delta, cursor: JobCursor) -> Final:
    ended_early = delta.finish_reason in (FinishReason.CANCELLED, FinishReason.ERROR)
    if ended_early and cursor.error is not None:
        # A job past its timeout_s ends with finish reason "timeout"; other runtime errors "error".
        reason = "timeout" if cursor.error.type == "timeout" else "error"
        return Final(JobStatus.FAILED, reason, cursor.error)
    if delta.finish_reason is FinishReason.ERROR:
        return Final(
            JobStatus.FAILED,
            "error",
            JobError(message=delta.error or "engine error", type=delta.error_type or "engine_error"),
        )
    if delta.finish_reason is FinishReason.CANCELLED:
        return Final(JobStatus.CANCELLED, "cancelled")
    assert delta.finish_reason is not None
    return Final(JobStatus.SUCCEEDED, delta.finish_reason.value)


def _terminal_entry(seq: int, final: Final, usage: Usage) -> LogEntry:
    if final.error is not None:
        return LogEntry.error(seq, ErrorEvent(message=final.error.message, type=final.error.type))
    return LogEntry.done(seq, DoneEvent(status=final.status, finish_reason=final.finish_reason, usage=usage))


def _top(lp: Logprob) -> TopLogprob:
    return TopLogprob(token=lp.token, token_id=lp.token_id, logprob=lp.logprob)


def _token_logprob(lp: TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(**_top(lp.chosen).model_dump(), top=[_top(t) for t in lp.top])


def _prompt_logprobs(delta: Delta) -> list[TokenLogprob | None] | None:
    if delta.prompt_logprobs is None:
        return None
    return [None if lp is None else _token_logprob(lp) for lp in delta.prompt_logprobs]


def build_append(delta: Delta, cursor: JobCursor) -> Append | None:
    """The writes for one delta; advances the cursor. None when the delta carries nothing."""
    if cursor.choice_of:
        return _choice_append(delta, cursor, cursor.choice_of[delta.request_id])
    cursor.prompt_tokens = delta.num_prompt_tokens or cursor.prompt_tokens
    cursor.completion_tokens = max(cursor.completion_tokens, delta.num_generated_tokens)
    entries: list[LogEntry] = []
    if delta.token_ids or delta.text or delta.prompt_logprobs is not None:
        # NOTE: a token event may carry ids and no text yet (held back for a stop string or an
        # unfinished UTF-8 sequence): the ids must be in the log for a resumed attempt. One
        # with max_tokens 0 carries only the prompt's logprobs.
        logprobs = None if delta.logprobs is None else [_token_logprob(lp) for lp in delta.logprobs]
        entries.append(
            token_entry(
                cursor.next(),
                cursor.next_index,
                delta.text,
                delta.token_ids,
                logprobs,
                prompt_logprobs=_prompt_logprobs(delta),
                prompt_tokens=delta.prompt_tokens,
            )
        )
        cursor.next_index += 1
    final = None
    if delta.finished:
        final = _final(delta, cursor)
        entries.append(
            _terminal_entry(cursor.next(), final, Usage.of(cursor.prompt_tokens, cursor.completion_tokens))
        )
    if not entries:
        return None
    cursor.unsaved += len(entries)
    cursor.unsaved_text += delta.text
    checkpoint = final is not None or entries[0].seq == 1 or cursor.unsaved >= TEXT_CHECKPOINT_EVENTS
    unsaved_text = cursor.unsaved_text
    if checkpoint:
        cursor.unsaved, cursor.unsaved_text = 0, ""
    return Append(
        cursor.job_id,
        cursor.attempt,
        entries,
        cursor.prompt_tokens,
        cursor.completion_tokens,
        final,
        checkpoint=checkpoint,
        unsaved_text=unsaved_text,
    )


def _choice_append(delta: Delta, cursor: JobCursor, choice: int) -> Append | None:
    """One choice's writes in a job with n > 1: its token event (choice, and on its last one
    the choice's finish_reason); once no choice is left, the job's terminal event, usage summed
    over the choices (the prompt counted once, as OpenAI does)."""
    # Set at the add (every prompt's, summed), or from the record on a take-over.
    cursor.prompt_tokens = cursor.prompt_tokens or delta.num_prompt_tokens
    cursor.generated[choice] = max(cursor.generated.get(choice, 0), delta.num_generated_tokens)
    cursor.completion_tokens = sum(cursor.generated.values())
    ends = delta.finished and choice in cursor.live
    entries: list[LogEntry] = []
    if delta.token_ids or delta.text or ends or delta.prompt_logprobs is not None:
        reason = delta.finish_reason.value if ends and delta.finish_reason is not None else None
        logprobs = None if delta.logprobs is None else [_token_logprob(lp) for lp in delta.logprobs]
        entries.append(
            token_entry(
                cursor.next(),
                cursor.next_index,
                delta.text,
                delta.token_ids,
                logprobs,
                choice,
                reason,
                _prompt_logprobs(delta),
                delta.prompt_tokens,
            )
        )
        cursor.next_index += 1
    if ends:
        cursor.live.discard(choice)
        assert delta.finish_reason is not None
        cursor.reasons[choice] = delta.finish_reason.value
        if delta.finish_reason is FinishReason.ERROR and (
            cursor.ending is None or cursor.ending.finish_reason is not FinishReason.ERROR
        ):
            cursor.ending = delta
        elif delta.finish_reason is FinishReason.CANCELLED and cursor.ending is None:
            cursor.ending = delta
    final = None
    if delta.finished and not cursor.live and not cursor.ended:
        cursor.ended = True
        if cursor.ending is not None:
            final = _final(cursor.ending, cursor)
        else:  # the job's finish_reason is choice 0's, as its text is choice 0's
            final = Final(JobStatus.SUCCEEDED, cursor.reasons.get(0, "stop"))
        usage = Usage.of(cursor.prompt_tokens, cursor.completion_tokens)
        entries.append(_terminal_entry(cursor.next(), final, usage))
    if not entries:
        return None
    return Append(
        cursor.job_id, cursor.attempt, entries, cursor.prompt_tokens, cursor.completion_tokens, final
    )


def _merged(appends: list[Append]) -> list[Append]:
    """One Append per job: a job with n > 1 has a delta per choice in a step."""
    by_job: dict[str, Append] = {}
    for a in appends:
        if (had := by_job.get(a.job_id)) is None:
            by_job[a.job_id] = a
        else:
            by_job[a.job_id] = Append(
                a.job_id, a.attempt, [*had.entries, *a.entries], a.prompt_tokens, a.completion_tokens, a.final
            )
    return list(by_job.values())


def prepare_appends(deltas: Sequence[Delta], cursors: Mapping[str, JobCursor]) -> list[Append]:
    """The writes for the deltas of jobs in ``cursors`` (by engine request id: a job's id,
    or each of its choices'), one Append per job (advances the cursors)."""
    appends = [a for d in deltas if d.request_id in cursors if (a := build_append(d, cursors[d.request_id]))]
    return _merged(appends) if len(appends) > len({a.job_id for a in appends}) else appends

import math

import pytest
from pydantic import ValidationError

from common.schemas.checks import LIMIT_EXCEEDED
from common.schemas.events import DoneEvent, LogEntry, TokenEvent
from common.schemas.requests import JobRequest
from common.schemas.views import JobStatus, Usage
from common.settings import Settings

SERVER = Settings(max_tokens_cap=4096)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"messages": []},
        {"prompt": "a", "temperature": math.nan},
        {"prompt": "a", "temperature": 2.5},
        {"prompt": "a", "top_p": 0},
        {"prompt": "a", "top_k": 0},
        {"prompt": "a", "max_tokens": 0},
        {"prompt": "a", "max_tokens": 10**9},
        {"prompt": "a", "stop": ""},
        {"prompt": "a", "stop": ["x", ""]},
        {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]},
        {"prompt": "a", "timeout_s": math.inf},
        {"prompt": "a", "timeout_s": 0},
        {"prompt": "a", "unknown": 1},
        {"messages": [{"role": "robot", "content": "b"}]},
    ],
)
def test_invalid_requests_are_refused(body: dict) -> None:
    with pytest.raises(ValidationError):
        JobRequest.accept(body, SERVER)


def test_scoring_fields() -> None:
    # max_tokens 0 scores the prompt: only with prompt_logprobs or echo.
    for extra in ({"prompt_logprobs": 0}, {"echo": True}):
        assert JobRequest.accept({"prompt": "a", "max_tokens": 0, **extra}, SERVER).max_tokens == 0
    r = JobRequest.accept({"prompts": ["a", [1, 2]], "n": 3, "echo": True, "logprobs": 2}, SERVER)
    assert (r.num_choices, r.prompt_list, r.scored_logprobs) == (6, ["a", [1, 2]], 2)
    assert JobRequest.accept({"prompt": "a", "prompt_logprobs": 4}, SERVER).scored_logprobs == 4
    assert JobRequest.accept({"prompt": "a"}, SERVER).scored_logprobs is None
    refused: list[dict[str, object]] = [
        {"prompts": ["a"], "prompt": "b"},
        {"prompts": []},
        {"prompts": [[]]},
        {"prompts": [[-1]]},
        {"prompts": ["a"] * 33, "n": 2},  # 66 choices: above SPOOL_MAX_PROMPTS (64)
        {"messages": [{"role": "user", "content": "b"}], "echo": True},
        {"prompt": "a", "prompt_logprobs": 21},
        {"parts": [{"type": "text", "prompts": ["a", "b"]}]},
    ]
    for body in refused:
        with pytest.raises(ValidationError):
            JobRequest.accept(body, SERVER)


def test_the_servers_settings_give_the_default_and_the_cap() -> None:
    server = Settings(max_tokens_cap=16, default_max_tokens=5)
    assert JobRequest.accept({"prompt": "a"}, server).max_tokens == 5
    assert JobRequest.accept({"prompt": "a", "max_tokens": 16}, server).max_tokens == 16
    with pytest.raises(ValidationError) as refused:
        JobRequest.accept({"prompt": "a", "max_tokens": 17}, server)
    assert refused.value.errors()[0]["type"] == LIMIT_EXCEEDED
    # Read back from the store: the server that accepted it judged it, with its own settings.
    assert JobRequest.model_validate_json('{"prompt": "a", "max_tokens": 17}').max_tokens == 17


def test_request_defaults_and_stop_list() -> None:
    r = JobRequest(prompt="hi", stop="x")
    assert r.max_tokens >= 1 and r.temperature == 1.0 and r.background
    assert r.stop_list == ["x"]
    assert JobRequest(prompt="hi", stop=["a", "b"]).stop_list == ["a", "b"]
    assert JobRequest(prompt="hi").stop_list == []
    assert JobRequest.model_validate_json(r.model_dump_json()) == r


def test_request_rejects_nan_in_json() -> None:
    with pytest.raises(ValidationError):
        JobRequest.model_validate_json('{"prompt": "a", "top_p": NaN}')


def test_log_entries_round_trip_in_the_documented_shape() -> None:
    tok = LogEntry.token(1, TokenEvent(index=0, text="hé", token_ids=[5, 6]))
    done = LogEntry.done(2, DoneEvent(status=JobStatus.SUCCEEDED, finish_reason="stop", usage=Usage.of(3, 1)))
    assert LogEntry.decode(tok.encode()) == tok
    assert LogEntry.decode(done.encode()).model_dump() == {
        "seq": 2,
        "type": "done",
        "data": {
            "status": "succeeded",
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        },
    }
    assert not tok.terminal and done.terminal
    assert JobStatus.CANCELLED.terminal and not JobStatus.RUNNING.terminal

"""Settings that would weaken the service refuse to start, naming the variable."""

from __future__ import annotations

import subprocess

import pytest
from procs import SPOOL, free_port, spool_env

from common.settings import SettingsError, load_settings

BLANK_KEY_LISTS = [" , ", ",", " ", "key-one,,key-two", "key-one, "]


@pytest.mark.parametrize("value", BLANK_KEY_LISTS)
def test_a_blank_api_key_list_is_refused_at_start(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before the fix these parsed to no key (or fewer), and " , " served without authentication.
    monkeypatch.setenv("SPOOL_API_KEYS", value)
    with pytest.raises(SettingsError, match="SPOOL_API_KEYS"):
        load_settings()


def test_spool_api_with_a_blank_key_list_exits_naming_the_variable() -> None:
    env = spool_env("test-blank-keys", api_keys=" , ")
    argv = [SPOOL, "api", "--host", "127.0.0.1", "--port", str(free_port())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "SPOOL_API_KEYS" in done.stderr


def test_spool_api_with_a_client_key_but_no_keys_exits_naming_both() -> None:
    # SPOOL_API_KEY is a client's key: an API started with it alone would serve without keys.
    env = spool_env("test-client-key", api_key="key-one")
    argv = [SPOOL, "api", "--host", "127.0.0.1", "--port", str(free_port())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "SPOOL_API_KEY is set but SPOOL_API_KEYS is not" in done.stderr


def test_keys_with_spaces_around_them_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOOL_API_KEYS", " key-one , key-two ")
    assert load_settings().api_key_set == {"key-one", "key-two"}

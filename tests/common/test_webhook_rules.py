"""Webhooks' pure parts (common/webhooks.py): the address check, signing per key, the envelope's
trim and the backoff's schedule. End to end: tests/test_webhooks.py."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import standardwebhooks

from common.webhooks import (
    BadDestination,
    address_refused,
    check_destination,
    new_secret,
    owner_secrets,
    retry_delay,
    signed_headers,
    trimmed_job,
)


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("127.0.0.1", True),
        ("10.0.0.5", True),
        ("192.168.1.1", True),
        ("169.254.169.254", True),  # cloud metadata
        ("224.0.0.251", True),
        ("0.0.0.0", True),
        ("::1", True),
        ("fe80::1%eth0", True),
        ("::ffff:127.0.0.1", True),  # IPv4-mapped loopback
        ("fd00::1", True),
        ("::127.0.0.1", True),  # IPv4-compatible
        ("64:ff9b::169.254.169.254", True),  # NAT64 of the metadata address
        ("64:ff9b:1::1", True),  # NAT64 for local use
        ("2002:7f00:1::", True),  # 6to4 of 127.0.0.1
        ("fec0::1", True),  # site-local
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", True),  # Teredo
        ("8.8.8.8", False),
        ("2606:4700:4700::1111", False),
        ("64:ff9b::8.8.8.8", False),  # NAT64 (DNS64) of a global address
        ("2002:808:808::1", False),  # 6to4 of a global address
    ],
)
def test_refused_addresses(address: str, refused: bool) -> None:
    assert address_refused(address) is refused


def test_a_name_is_checked_by_what_it_resolves_to_unless_allowed() -> None:
    with pytest.raises(BadDestination, match="127.0.0.1"):
        asyncio.run(check_destination("http://localhost:9/x", False, frozenset()))
    assert "127.0.0.1" in asyncio.run(check_destination("http://localhost:9/x", False, {"localhost"}))
    assert asyncio.run(check_destination("http://127.0.0.1:9/x", True, frozenset())) == ["127.0.0.1"]


def test_each_key_signs_with_its_own_secrets_and_every_one_verifies() -> None:
    server = [new_secret(), new_secret()]
    assert owner_secrets(server, "") == server  # no API keys: the server's own
    alice, bob = owner_secrets(server, "alice"), owner_secrets(server, "bob")
    assert alice != bob and len(alice) == 2 and owner_secrets(server, "alice") == alice
    body = b'{"id":"evt_1","type":"job.completed"}'
    headers = signed_headers(alice, "evt_1", body)
    for secret in alice:  # during a rotation, a receiver with either secret verifies
        assert standardwebhooks.Webhook(secret).verify(body, headers)["id"] == "evt_1"
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(bob[0]).verify(body, headers)


def test_a_large_job_is_sent_without_its_text() -> None:
    job = {"id": "j", "text": "x" * 5000, "parts": [{"index": 0, "text": "y" * 5000}, {"index": 1}]}
    assert trimmed_job(job, "/v1/jobs/j", 20_000) == job
    small = trimmed_job(job, "/v1/jobs/j", 2048)
    assert small["text"] is None and small["parts"][0]["text"] is None and small["text_truncated"]
    assert small["url"] == "/v1/jobs/j" and len(json.dumps(small)) < 2048


def test_the_backoff_grows_with_jitter_and_a_cap() -> None:
    rng = random.Random(7)
    delays = [retry_delay(n, 2.0, rng) for n in range(1, 8)]
    assert all(a < b for a, b in zip(delays, delays[1:], strict=False))  # 2^n outgrows +-25 %
    assert 1.5 <= delays[0] <= 2.5
    assert retry_delay(40, 2.0, rng) <= 3600 * 1.25

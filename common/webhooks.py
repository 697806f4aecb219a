"""Webhooks' pure parts, shared by the API (checks at submit) and the hook workers (delivery):
the events a request may ask for, the destination check, Standard Webhooks signing, the envelope
and the retries' schedule. No Redis here (common/store/hooks.py), no HTTP client.

What a receiver sees: docs/webhooks.md.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import random
import socket
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

# What a request's ``webhook_events`` may name, and the event type each becomes on a job.
JOB_EVENTS = {"start": "job.started", "part": "job.part", "completed": "job.completed"}
DEFAULT_EVENTS = ("completed",)
# A batch's ends (batch.completed, batch.failed, ...): every one by default.
BATCH_EVENTS = ("completed", "failed", "cancelled", "expired")
MAX_URL_CHARS = 2048
MAX_ENDPOINTS = 10  # server-wide endpoints per API key (POST /v1/webhook_endpoints)
SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32


class BadDestination(ValueError):
    """A webhook URL that is refused (its message says why)."""


class RefusedAddress(BadDestination):
    """A webhook host that resolves to an address the guard refuses (``address_refused``). At an
    attempt it is a permanent failure: the delivery is not retried."""


def check_events(events: Sequence[str]) -> list[str]:
    """The events in a stable order; ValueError naming any that is not one."""
    unknown = sorted(set(events) - set(JOB_EVENTS))
    if unknown:
        raise ValueError(f"unknown webhook event(s) {', '.join(unknown)}; use {', '.join(JOB_EVENTS)}")
    return [e for e in JOB_EVENTS if e in events]


def check_url_form(url: str) -> str:
    """An http or https URL with a host, no user info and no fragment (BadDestination if not)."""
    if len(url) > MAX_URL_CHARS:
        raise BadDestination(f"the webhook URL is longer than {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise BadDestination(f"the webhook URL is not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadDestination("the webhook URL must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None or parts.fragment:
        raise BadDestination("the webhook URL must have no user info and no fragment")
    return url


# IPv6 ranges refused whatever Python calls them (3.11 calls most of them global): deprecated or
# local ones, and a tunnel whose far end cannot be checked.
_V6_REFUSED = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "::/96",  # IPv4-compatible (RFC 4291, deprecated): ::127.0.0.1 is loopback in disguise
        "64:ff9b:1::/48",  # NAT64 for local use (RFC 8215): a network's own translator
        "fec0::/10",  # site-local (RFC 3879, deprecated): a private range
        "2001::/32",  # Teredo (RFC 4380): a tunnel to an IPv4 address
    )
)
# IPv6 forms that carry an IPv4 address in their low 32 bits: checked as that address.
_LOW_32 = (
    ipaddress.IPv6Network("64:ff9b::/96"),  # NAT64's well-known prefix (RFC 6052)
    ipaddress.IPv6Network("::ffff:0:0:0/96"),  # IPv4-translated (SIIT, RFC 6145)
)


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for: IPv4-mapped (``::ffff:a.b.c.d``), NAT64
    (``64:ff9b::a.b.c.d``), IPv4-translated (``::ffff:0:a.b.c.d``) or 6to4
    (``2002:AABB:CCDD::``); None for the others."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if any(ip in net for net in _LOW_32):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


def address_refused(address: str) -> bool:
    """Loopback, private, link-local (cloud metadata), multicast, reserved or unspecified, in
    whatever form: an IPv6 address that embeds an IPv4 one is checked as that IPv4 address, and
    the IPv6 ranges of ``_V6_REFUSED`` are refused outright."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if any(ip in net for net in _V6_REFUSED):
            return True
        if (v4 := embedded_ipv4(ip)) is not None:
            return not v4.is_global or v4.is_multicast
    return not ip.is_global or ip.is_multicast


def host_allowed(host: str, allow_private: bool, allow_hosts: Iterable[str]) -> bool:
    """Whether a host skips the private-address check."""
    return allow_private or host.lower().rstrip(".") in allow_hosts


async def resolve_checked(host: str, port: int, allow: bool) -> list[str]:
    """The addresses ``host`` resolves to, every one checked (BadDestination when one is refused or
    none is found). ``allow``: the host skips the check. Called at submit and again at each connect,
    whose socket goes to an address checked here, so a name that resolves elsewhere later (DNS
    rebinding) is caught."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise BadDestination(f"the webhook host {host!r} does not resolve ({e})") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise BadDestination(f"the webhook host {host!r} does not resolve")
    refused = [a for a in addresses if address_refused(a)]
    if refused and not allow:
        raise RefusedAddress(
            f"the webhook host {host!r} resolves to {refused[0]}, a loopback, private, link-local or "
            "multicast address (SPOOL_WEBHOOK_ALLOW_PRIVATE, SPOOL_WEBHOOK_ALLOW_HOSTS)"
        )
    return addresses


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


async def check_destination(url: str, allow_private: bool, allow_hosts: Iterable[str]) -> list[str]:
    """The checked addresses of a webhook URL's host (BadDestination when refused)."""
    host, port = host_port(check_url_form(url))
    return await resolve_checked(host, port, host_allowed(host, allow_private, allow_hosts))


# -- signing (https://www.standardwebhooks.com) ---------------------------------------------------


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(random.SystemRandom().randbytes(SECRET_BYTES)).decode()


def check_secret(secret: str) -> bytes:
    """A ``whsec_`` secret's key bytes (ValueError when it is not one)."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"a webhook secret starts with {SECRET_PREFIX}")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except ValueError:
        raise ValueError("a webhook secret is whsec_ and base64") from None
    if len(key) < 16:
        raise ValueError("a webhook secret holds at least 16 bytes")
    return key


def owner_secrets(server_secrets: Sequence[str], owner: str) -> list[str]:
    """The secrets an owner's webhooks are signed with: the server's own without API keys (owner
    ""), else one derived per API key from each server secret (a rotation rotates them all)."""
    if not owner:
        return list(server_secrets)
    derived = [
        hmac.new(check_secret(s), f"spool-webhook:{owner}".encode(), hashlib.sha256) for s in server_secrets
    ]
    return [SECRET_PREFIX + base64.b64encode(d.digest()).decode() for d in derived]


def signature_header(secrets: Sequence[str], msg_id: str, timestamp: int, body: bytes) -> str:
    """``webhook-signature``: ``v1,{base64 HMAC-SHA256 of "{id}.{timestamp}.{body}"}`` per secret."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    sigs = [hmac.new(check_secret(s), signed, hashlib.sha256).digest() for s in secrets]
    return " ".join("v1," + base64.b64encode(s).decode() for s in sigs)


def signed_headers(
    secrets: Sequence[str], msg_id: str, body: bytes, now: float | None = None
) -> dict[str, str]:
    timestamp = int(time.time() if now is None else now)
    return {
        "content-type": "application/json",
        "user-agent": "spool-webhooks/1",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature_header(secrets, msg_id, timestamp, body),
    }


# -- the envelope and the schedule ------------------------------------------------------------


def envelope(event_id: str, event_type: str, created_at: float, data: dict[str, Any]) -> bytes:
    return json.dumps(
        {"id": event_id, "type": event_type, "created_at": int(created_at), "object": "event", "data": data},
        separators=(",", ":"),
    ).encode()


def trimmed_job(job: dict[str, Any], url: str, max_bytes: int) -> dict[str, Any]:
    """A job's data without its texts when it is larger than ``max_bytes`` as JSON: ``text`` (and
    each part's) becomes null, ``text_truncated`` true and ``url`` where GET returns it whole."""
    if len(json.dumps(job).encode()) <= max_bytes:
        return job
    parts = [{**p, "text": None} if "text" in p else p for p in job.get("parts") or []]
    return {**job, "text": None, "parts": parts, "text_truncated": True, "url": url}


def retry_delay(attempts: int, base_s: float, rng: random.Random | None = None) -> float:
    """The wait after the ``attempts``-th failed attempt: base * 2^(attempts-1), jittered by
    +-25 %, at most an hour."""
    jitter = (rng or random).uniform(0.75, 1.25)
    return float(min(base_s * 2 ** min(attempts - 1, 30), 3600.0) * jitter)

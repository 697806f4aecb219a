"""Tenants: the API keys that share the workers, named by a short hash of the key, never the key."""

from __future__ import annotations

TENANT_CHARS = 12  # hex digits of the owner (the key's SHA-256, api/auth.py), so 48 bits


def tenant_of(owner: str) -> str:
    """A job's tenant: what the engine's fair shares, SPOOL_TENANT_WEIGHTS and the metrics' `tenant`
    label name it by; "" without API keys (one tenant)."""
    return owner[:TENANT_CHARS]

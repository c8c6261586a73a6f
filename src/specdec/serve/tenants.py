"""Tenants: who may read what the server learned from whose traffic.

A tenant is the API key's name in `--api-key-file` (lines `KEY [TENANT]`), else a hash of
the key, so callers with different keys never share a prefix cache or the suffix drafter's
learned state (issue 16: one caller could otherwise probe what others sent by watching its
own acceptance and cached tokens). A request's `cache_salt` (as in vLLM) splits a tenant
further: requests with different salts share nothing either. Without keys every caller is
the tenant "" (one trust domain), still split by `cache_salt`.
"""

from __future__ import annotations

import hashlib
import re

from specdec.errors import SpecdecError

_TENANT_NAME = re.compile(r"^[A-Za-z0-9._:@/-]{1,128}$")


def key_tenant(key: str, name: str | None = None) -> str:
    """A key's tenant: its name, or a hash that identifies the key without revealing it."""
    return name or "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def request_tenant(key_tenant_: str, cache_salt: str | None) -> str:
    """The scope of one request's shared state: the key's tenant, split by `cache_salt`
    (hashed: tenants appear in access logs, salts must not)."""
    if not cache_salt:
        return key_tenant_
    return f"{key_tenant_}#salt-{hashlib.sha256(cache_salt.encode()).hexdigest()[:16]}"


def read_api_keys(path: str) -> dict[str, str]:
    """`--api-key-file`: one key per line, optionally followed by its tenant's name; blank
    lines and lines starting with # are skipped. Returns key -> tenant."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"--api-key-file {path}: {getattr(e, 'strerror', None) or e}",
                           "api_key_file") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"--api-key-file {path}, line {number}"
        if len(fields) > 2:
            raise SpecdecError(f"{where}: expected 'KEY [TENANT]', got {len(fields)} fields", "api_key_file")
        key, name = fields[0], (fields[1] if len(fields) == 2 else None)
        if name is not None and not _TENANT_NAME.match(name):
            raise SpecdecError(f"{where}: a tenant name is 1 to 128 of A-Z a-z 0-9 . _ : @ / -",
                               "api_key_file")
        if key in keys:
            raise SpecdecError(f"{where}: this key is listed twice", "api_key_file")
        keys[key] = key_tenant(key, name)
    if not keys:
        raise SpecdecError(f"--api-key-file {path}: no keys in the file", "api_key_file")
    return keys

"""Session-affine routing for `specdec serve --replicas N` (no Ray needed here).

An agent's next turn pays off only on the replica that holds its state: the prefix cache of
its conversation and the suffix statistics of its earlier replies. So each request gets a
conversation key and goes to the replica that owns the key, unless that replica is saturated
(its batch is full) or down, in which case the least-loaded replica takes it.

The key, in order: the request's `prompt_cache_key` (OpenAI's routing hint), its `user`, else
a hash of what stays fixed across a conversation's turns: the system prompt and the first user
message (chat), or the start of the prompt (completions).

Ownership is jump consistent hashing (Lamping & Veach 2014, "A Fast, Minimal Memory,
Consistent Hash Algorithm"): replicas are numbered 0..N-1, and going from N to N+1 replicas
moves only 1/(N+1) of the keys.
"""

from __future__ import annotations

import hashlib
import json
import random
import time

ROUTING_MODES = ("affinity", "random")
COMPLETION_KEY_CHARS = 512  # a completions prompt grows each turn; its start names the conversation
DOWN_RETRY_S = 1.0  # a replica marked down is probed again after this long


def _text(content) -> str:
    """A message's content as text (a string or a list of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def conversation_key(body) -> str | None:
    """The routing key of a parsed request body, or None when it names no conversation.

    >>> conversation_key({"user": "agent-7", "messages": []})
    'user:agent-7'
    """
    if not isinstance(body, dict):
        return None
    for field in ("prompt_cache_key", "user"):
        if isinstance(body.get(field), str) and body[field]:
            return f"{field.split('_')[-1]}:{body[field]}"
    messages = body.get("messages")
    if isinstance(body.get("input"), str | list):  # the Responses API: instructions, then input as messages
        items = ([{"role": "user", "content": body["input"]}] if isinstance(body["input"], str)
                 else body["input"])
        system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
        messages = [*system, *items]
    if isinstance(messages, list):
        messages = [m for m in messages if isinstance(m, dict)]
        system = [_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
        first_user = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), None)
        if first_user is None and not system:
            return None
        seed = json.dumps([system, first_user])
    elif isinstance(body.get("prompt"), str | list):
        seed = json.dumps(body["prompt"])[:COMPLETION_KEY_CHARS]
    else:
        return None
    return "hash:" + hashlib.blake2b(seed.encode(), digest_size=16).hexdigest()


def jump_hash(key: str, buckets: int) -> int:
    """The bucket in [0, buckets) that owns `key` (jump consistent hash)."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    k = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    b, j = -1, 0
    while j < buckets:
        b = j
        k = (k * 2862933555777941143 + 1) % 2**64
        j = int((b + 1) * (2**31 / ((k >> 33) + 1)))
    return b


class ReplicaRouter:
    """Picks a replica per request and tracks each replica's requests in flight.

    `capacity` is how many requests a replica decodes at once (its max batch): a preferred
    replica with that many in flight is saturated, and a less-loaded one takes the request.
    The ingress calls `acquire` before dispatching and `release` when the response ends.
    """

    def __init__(self, num_replicas: int, capacity: int, mode: str = "affinity",
                 rng: random.Random | None = None):
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
        self.num_replicas, self.capacity, self.mode = num_replicas, capacity, mode
        self.in_flight = [0] * num_replicas
        self.down_since: dict[int, float] = {}  # replica -> when it was found down
        self._rng = rng or random.Random()

    def choose(self, key: str | None) -> tuple[int | None, str]:
        """(replica, why): `affinity` (the key's owner), `fallback` (owner saturated or down),
        `least_loaded` (no key) or `random`; (None, "down") when every replica is down."""
        up = [i for i in range(self.num_replicas) if i not in self.down_since]
        if not up:
            return None, "down"
        least = min(up, key=lambda i: (self.in_flight[i], i))
        if self.mode == "random":
            return self._rng.choice(up), "random"
        if key is None:
            return least, "least_loaded"
        owner = jump_hash(key, self.num_replicas)
        if owner in up and (self.in_flight[owner] < self.capacity
                            or self.in_flight[least] >= self.in_flight[owner]):
            return owner, "affinity"
        return least, "fallback"

    def acquire(self, replica: int) -> None:
        self.in_flight[replica] += 1

    def release(self, replica: int) -> None:
        self.in_flight[replica] -= 1

    def mark_down(self, replica: int) -> None:
        self.down_since.setdefault(replica, time.monotonic())

    def mark_up(self, replica: int) -> None:
        self.down_since.pop(replica, None)

    def due_for_probe(self) -> list[int]:
        """Down replicas not probed for DOWN_RETRY_S; each call restarts their clock."""
        now = time.monotonic()
        due = [i for i, since in self.down_since.items() if now - since >= DOWN_RETRY_S]
        for i in due:
            self.down_since[i] = now
        return due

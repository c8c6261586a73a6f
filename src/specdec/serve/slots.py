"""What the scheduler hands out per request: a KV cache slot, a drafter, and a step budget.

- `BackendSlots`: the target's KV caches, bounded in number; a finished request's slot keeps
  its cache for prompts of the same tenant that start the same way, and the least recently
  used idle slot is evicted when a new one is needed and none may be made.
- `DrafterPool`: drafter instances by spec text, reused between requests.
- `LoadPolicy`: how much speculation and prefill one scheduler step may do.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.backends import Backend, make_backend
from specdec.drafters import Drafter, make_drafter
from specdec.errors import SpecdecError

DEFAULT_PREFILL_TOKENS = 256  # two 128-token chunks a step (prefix_cache.PREFILL_CHUNK)


@dataclass
class LoadPolicy:
    """How much work one scheduler step does when many requests share the target.

    A saturated batch is compute-bound, so extra draft tokens stop being nearly free. The
    tokens scored per step, all requests together, are capped at `max_batch_tokens`: each of
    n active requests drafts at most max_batch_tokens // n - 1 tokens (0 turns speculation off),
    and above `spec_off_above` active requests speculation is off altogether.

    New prompts are prefilled `prefill_tokens` tokens a step, all prefilling requests together
    (at least one chunk), between the decode steps of the running requests (chunked prefill,
    as vLLM and SGLang do), so that a long prompt does not freeze the other streams. 0 prefills
    each prompt whole when it is admitted.
    """

    max_batch_tokens: int = 128  # 0: no cap
    spec_off_above: int = 0  # 0: never
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS  # 0: whole prompts at admission

    def k_cap(self, num_active: int) -> int | None:
        if self.spec_off_above and num_active > self.spec_off_above:
            return 0
        if not self.max_batch_tokens or num_active == 0:
            return None
        return max(0, self.max_batch_tokens // num_active - 1)


class BackendSlots:
    """Per-request KV caches over the shared target weights, at most `max_slots` of them.

    With a pooled backend (its `pool` is a `SlotPool`) a slot is a sequence of the pool (which
    bounds them too); otherwise it is a fresh backend from `make_backend`. A slot whose request
    ended keeps its cache: the next request of the same tenant goes to the idle slot that
    holds the longest prefix of its prompt (`PrefixCache`), so agents that resend their
    conversation, or share a system prompt and tool list, skip most of their prefill. Where
    that slot holds another conversation past the shared prefix and the pool has a free slot,
    the prefix is copied there (`SlotPool.fork`), so the other conversation stays warm too. A
    prompt that no idle slot helps gets a new slot while fewer than `max_slots` exist, else the
    least recently used idle one, emptied. A slot never serves a prefix cached for another tenant.
    """

    def __init__(self, kind: str, target, options: dict | None = None, prefix_cache: str = "prompt",
                 max_slots: int | None = None):
        if max_slots is not None and max_slots < 1:
            raise SpecdecError(f"need at least one cache slot, got {max_slots}", "cache_slots")
        self.kind, self.target, self.options = kind, target, dict(options or {})
        self.prefix_cache = prefix_cache  # every slot's prefix cache runs in this mode
        self.max_slots = max_slots  # None: as many as the pool has (unbounded without a pool)
        first = self._new_backend()
        self.pool = first.pool
        self.max_length = int(first.max_length)
        self._free: list[Backend] = [first]  # least recently released first
        self._tenant: dict[int, str] = {id(first): ""}  # id(slot) -> the tenant its cache belongs to
        self.in_use = 0

    @property
    def num_slots(self) -> int:
        """Slots made so far, in use or idle."""
        return self.in_use + len(self._free)

    def _new_backend(self) -> Backend:
        return make_backend(self.kind, self.target, prefix_cache=self.prefix_cache, **self.options)

    def acquire(self, prompt_ids: list[int] | None = None, tenant: str = "") -> Backend:
        """A slot for a request of `tenant`; the one whose cache holds the longest prefix of
        `prompt_ids` among that tenant's idle slots."""
        hits = [
            b.prefix_cache.cached_prefix(prompt_ids) if prompt_ids and self._tenant[id(b)] == tenant else 0
            for b in self._free
        ]
        best = max(range(len(hits)), key=hits.__getitem__) if hits else None
        if best is not None and hits[best] > 0 and self._branches(self._free[best], prompt_ids):
            backend = self.pool.fork(self._free[best], hits[best])  # both conversations stay warm
        elif best is not None and (hits[best] > 0 or not self._can_grow()):
            backend = self._free.pop(best)  # a hit, or else the least recently used slot
            if hits[best] == 0:
                backend.reset()  # evicted: its cache (perhaps another tenant's) is dropped
        elif self.pool is not None:
            backend = self.pool.new_sequence()  # in the pool's prefix cache mode
        else:
            backend = self._new_backend()
        self._tenant[id(backend)] = tenant
        self.in_use += 1
        return backend

    def _branches(self, slot: Backend, prompt_ids: list[int]) -> bool:
        """Whether the prompt shares only a prefix with another conversation held in `slot` (a
        system prompt and tool list, say), and the pool can copy that prefix into a free slot
        rather than evict the rest of that conversation."""
        return self.pool is not None and self._can_grow() and not slot.prefix_cache.extended_by(prompt_ids)

    def _can_grow(self) -> bool:
        if self.max_slots is not None and self.num_slots >= self.max_slots:
            return False
        return self.pool is None or self.pool.free_slots > 0

    def release(self, backend: Backend, keep_cache: bool = True) -> None:
        self.in_use -= 1
        if not keep_cache:
            backend.reset()
        self._free.append(backend)


class DrafterPool:
    """Drafter instances by spec text. One instance serves one request at a time (`begin`
    resets it); idle instances are reused so a model drafter is not reloaded per request."""

    def __init__(self, target, device: str | None = None):
        self.target, self.device = target, device
        self._idle: dict[str, list[Drafter]] = {}

    def acquire(self, spec: str) -> Drafter:
        idle = self._idle.get(spec)
        return idle.pop() if idle else make_drafter(spec, self.target, self.device)

    def release(self, spec: str, drafter: Drafter) -> None:
        self._idle.setdefault(spec, []).append(drafter)

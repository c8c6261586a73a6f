"""Per-request speculative decoding statistics, in vLLM's vocabulary.

A step is one target forward during decoding. It emits its accepted draft tokens plus one
recovered or bonus token. τ (mean_accepted_length) is tokens emitted per step, bonus
included, as Spec-Bench counts it: plain decoding has τ = 1.

Forced tokens are the tokens a grammar forces (structured output, grammar.py). They lead
the draft and are always accepted; they count in τ and in the emitted tokens, but not in
the drafter's drafted / accepted tokens, its acceptance rate or its per-position counts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    num_steps: int = 0  # target forwards while decoding
    num_drafts: int = 0  # steps that verified a non-empty draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_forced_tokens: int = 0  # accepted tokens a grammar forced; not in num_draft/accepted_tokens
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted
    drafted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts that had a token i
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted by each step
    k_history: list[int] = field(default_factory=list)  # k the controller chose at each step
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose keys/values an earlier prefill left in the cache
    prefill_s: float = 0.0
    propose_s: float = 0.0
    score_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    def observe_step(self, num_drafted: int, num_accepted: int, num_emitted: int, k: int,
                     forced: int = 0) -> None:
        """num_drafted / num_accepted: the drafter's tokens; forced: grammar-forced ones."""
        self.num_steps += 1
        self.num_forced_tokens += forced
        self.k_history.append(k)
        self.accept_lengths.append(num_emitted)
        self.num_emitted_tokens += num_emitted
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        grow = num_drafted - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos.extend([0] * grow)
            self.accepted_per_pos.extend([0] * grow)
        for i in range(num_drafted):
            self.drafted_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_emitted_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        """The flat numbers a user reads; the long per-step lists stay out."""
        return {
            "steps": self.num_steps,
            "drafts": self.num_drafts,
            "drafted_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "forced_tokens": self.num_forced_tokens,
            "generated_tokens": self.num_emitted_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_pos": list(self.accepted_per_pos),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "wall_time_s": round(self.wall_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "propose_s": round(self.propose_s, 4),
            "score_s": round(self.score_s, 4),
            "verify_s": round(self.verify_s, 4),
        }

    def to_dict(self) -> dict:
        return asdict(self)

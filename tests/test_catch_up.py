"""A drafter's catch-up on the context: priced per token read, not as drafting, and a probe from
a window of the last tokens when reading everything does not fit the loss budget."""

from __future__ import annotations

import pytest

from specdec.controller import FIXED_COSTS_ENV, AdaptiveK, ScoreCosts
from specdec.drafters import Draft, Drafter
from specdec.drafters.common import common_prefix


class Clock:
    now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Reader(Drafter):
    """A draft model on a fake clock: `read_s` per context token it has not seen, `draft_s` per
    token it drafts; it proposes `token` k times."""

    name = "reader"

    def __init__(self, clock: Clock, read_s: float, draft_s: float, window: int | None, token: int = 5):
        self.clock, self.read_s, self.draft_s, self.window, self.token = clock, read_s, draft_s, window, token
        self.seen: list[int] = []
        self.contexts: list[int] = []  # the length of each context it was given

    def backlog(self, context_ids):
        return len(context_ids) - common_prefix(self.seen, context_ids, len(context_ids))

    def probe_window(self):
        return self.window

    def propose(self, context_ids, k):
        self.clock.now += self.read_s * self.backlog(context_ids) + self.draft_s * k
        self.seen = list(context_ids)
        self.contexts.append(len(context_ids))
        return Draft([self.token] * k)


@pytest.fixture
def clock(monkeypatch):
    import specdec.engine as engine_mod
    import specdec.sequence as sequence_mod

    monkeypatch.delenv(FIXED_COSTS_ENV, raising=False)  # these tests feed the measuring model fake times
    clock = Clock()
    monkeypatch.setattr(sequence_mod, "time", clock)  # the proposals' times
    monkeypatch.setattr(engine_mod, "time", clock)  # the forwards take no time: costs stay as `measured`
    return clock


def measured(t1: float = 0.1, slope: float = 0.1, clock: Clock | None = None) -> ScoreCosts:
    costs = ScoreCosts(clock=clock.perf_counter) if clock else ScoreCosts()
    for n in ScoreCosts.CALIBRATION_SIZES:  # a target step of t1, rows at slope each
        costs.observe(n, t1 * (1 + slope * (n - 1)))
    costs.calibrated = True
    return costs


def test_a_catch_up_is_priced_as_reading_not_as_drafting(clock):
    """A draft model's first proposal also reads the prompt (2 s here). Taken as the cost of its
    one drafted token, that time would price every later draft out; it teaches the cost of a
    token read, and the drafter's own backlog says what a later request still has to read."""
    from conftest import tiny_llama
    from specdec.engine import Engine

    target = tiny_llama()
    prompt = list(range(3, 203))
    right = Engine(target, drafter="none").generate(prompt, max_new_tokens=1, chat=False).token_ids[0]
    drafter = Reader(clock, read_s=0.01, draft_s=0.1, window=None, token=right)  # its probe wins
    engine = Engine(target, drafter=drafter, k="auto")
    engine.costs = measured()
    first = engine.generate(prompt, max_new_tokens=6, chat=False).stats
    assert first.num_draft_tokens == 1 and drafter.contexts[0] == 200  # the probe read it all
    assert engine.costs.read_known and engine.costs.t_read == pytest.approx(0.01, rel=0.05)
    assert not engine.costs.draft_known  # nothing was learned of drafting from the catch-up
    second = engine.generate(prompt, max_new_tokens=6, chat=False).stats  # nothing new to read
    assert second.num_draft_tokens > 0
    assert engine.costs.t_draft == pytest.approx(0.1, rel=0.05)


@pytest.mark.parametrize(("read_s", "draft_s"), [(0.01, 0.02), (0.004, 0.05), (0.02, 0.01)])
def test_a_draft_model_that_never_wins_costs_at_most_three_percent(clock, read_s, draft_s):
    """From a cold controller, after a 400-token prompt, a draft model none of whose tokens is
    accepted costs at most 3% of a 160-token reply's plain time (0.1 s a step): it probes from
    its last 32 tokens. Made to read the whole context instead, it costs far more."""
    from conftest import tiny_llama
    from specdec.engine import Engine

    target = tiny_llama(max_positions=1024)
    prompt = [3 + i % 300 for i in range(400)]

    def cost(window):
        drafter = Reader(clock, read_s, draft_s, window)
        engine = Engine(target, drafter=drafter, k="auto")
        engine.costs = measured()
        clock.now = 0.0
        stats = engine.generate(prompt, max_new_tokens=160, chat=False).stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0
        extra_rows = 0.1 * 0.1 * stats.num_draft_tokens
        return (clock.now + extra_rows) / (0.1 * stats.num_emitted_tokens), drafter.contexts

    share, contexts = cost(window=32)
    assert share <= 0.03 and contexts[0] == 8, (share, contexts)
    unwindowed, _ = cost(window=None)
    assert unwindowed > 0.1


@pytest.mark.parametrize(("t_read", "backlog", "window", "expected"), [
    (None, 400, 32, (1, 8)),  # cost unknown: a short probe prices reading
    (None, 400, None, (1, 400)),  # no window: one drafted token after reading it all
    (1e-5, 400, 32, (4, 400)),  # cheap reading: all of it
    (0.0005, 400, 32, (3, 32)),  # dearer: the window, k cut to what its read leaves
    (0.003, 400, 32, (1, 13)),  # dearer still: what fits of the window, one drafted token
    (0.02, 400, 32, (0, 0)),  # too dear for even a short probe: plain
    (0.02, 400, None, (0, 400)),  # dear reading and no window: plain
    (0.02, 20, 32, (4, 20)),  # a steady proposal's few new tokens are part of drafting
])
def test_reading_takes_the_backlog_when_it_fits_else_the_window(monkeypatch, t_read, backlog, window,
                                                               expected):
    monkeypatch.delenv(FIXED_COSTS_ENV, raising=False)
    costs = measured()
    costs.observe_draft(1, 0.0)  # drafting is free: only reading is priced
    if t_read is not None:
        costs.observe_draft(1, t_read * 100, read=100)
    controller = AdaptiveK(costs=costs)
    assert controller.reading(4, backlog, window) == expected


class Oracle(Reader):
    """Knows the plain reply: drafts its next tokens after wherever the context's last 8
    tokens sit in it (so a window works too), and reads like a model (backlog, window)."""

    name = "oracle"

    def __init__(self, clock: Clock, sequence: list[int]):
        super().__init__(clock, read_s=0.0, draft_s=0.0, window=32)
        self.sequence = sequence

    def propose(self, context_ids, k):
        super().propose(context_ids, k)
        tail = context_ids[-8:]
        ends = [i + 8 for i in range(len(self.sequence) - 7) if self.sequence[i : i + 8] == tail]
        return Draft(self.sequence[ends[-1] : ends[-1] + k] if ends else [])


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_probes_from_a_window_keep_greedy_output_exact(backend):
    """A drafter whose catch-up is dear probes from a window of the last tokens, then reads
    everything once its wins pay for it: the reply is plain greedy decoding's, token for
    token, and its drafts were accepted."""
    from conftest import tiny_llama
    from specdec.engine import Engine

    target = tiny_llama(max_positions=512)
    prompt = [3 + (i * 7) % 300 for i in range(150)]
    plain = Engine(target, drafter="none", backend=backend).generate(prompt, max_new_tokens=64, chat=False)
    drafter = Oracle(Clock(), prompt + plain.token_ids)
    engine = Engine(target, drafter=drafter, k="auto", backend=backend)
    engine.costs = ScoreCosts(fixed={1: 1.0, 17: 2.6}, fixed_read=0.01)  # 150 tokens: 1.5 steps' worth
    result = engine.generate(prompt, max_new_tokens=64, chat=False)
    assert result.token_ids == plain.token_ids
    assert result.stats.num_accepted_tokens > 0
    assert drafter.contexts[0] == 32 and max(drafter.contexts) > 150, drafter.contexts


def test_a_draft_model_reads_the_whole_context_after_a_probe_from_a_window():
    """A probe leaves the draft cache holding the window; the next proposal on the whole
    context drafts what a fresh draft model does."""
    from conftest import tiny_llama
    from specdec.backends import make_backend
    from specdec.drafters.draft_model import PROBE_WINDOW, ModelDrafter

    def drafter():
        return ModelDrafter(make_backend("hf", tiny_llama(max_positions=512)), set())

    context = [3 + (i * 7) % 300 for i in range(150)]
    probed = drafter()
    assert probed.backlog(context) == 150 and probed.probe_window() == PROBE_WINDOW
    probed.propose(context[-PROBE_WINDOW:], 4)
    assert probed.backlog(context) == 150  # the window sits at the wrong positions
    assert probed.propose(context, 4).tokens == drafter().propose(context, 4).tokens
    assert probed.backlog(context + [9]) == 1


def test_calibration_prices_a_draft_model_before_its_first_proposal(monkeypatch):
    """At start-up a draft model is timed on made-up contexts, as the target's rows are: a read
    and a steady proposal. A drafter that reads cheaply is left to its first proposals."""
    monkeypatch.delenv(FIXED_COSTS_ENV, raising=False)
    clock = Clock()
    costs = ScoreCosts(clock=clock.perf_counter)
    costs.calibrate_drafter(Reader(clock, read_s=0.001, draft_s=0.02, window=32))
    assert costs.draft_known and costs.t_draft == pytest.approx(0.02, rel=0.05)
    assert costs.read_known and costs.t_read == pytest.approx(0.001, rel=0.05)
    cheap = ScoreCosts(clock=clock.perf_counter)
    cheap.calibrate_drafter(Drafter())
    assert not cheap.draft_known and not cheap.read_known


def test_a_draft_model_that_costs_more_than_it_can_save_is_not_tried(clock):
    """Priced at start-up at three target steps a token, a draft model cannot pay even at the
    prior's acceptance, and a probe never fits a 160-token request's loss budget."""
    from conftest import tiny_llama
    from specdec.engine import Engine

    drafter = Reader(clock, read_s=0.01, draft_s=0.3, window=32)
    engine = Engine(tiny_llama(max_positions=1024), drafter=drafter, k="auto")
    engine.costs = measured(clock=clock)
    engine.costs.calibrate_drafter(drafter)
    clock.now = 0.0
    stats = engine.generate([3 + i % 300 for i in range(400)], max_new_tokens=160, chat=False).stats
    assert stats.num_draft_tokens == 0 and clock.now == 0.0

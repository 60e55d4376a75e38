"""A Hypothesis rule-based state machine driving the torch ragged engine with submit /
round events: every round runs with check_invariants (I1-I6, S1), and every finished request must
equal target-only greedy decoding (S4), whatever was submitted when."""
import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_models import EOS, VOCAB, oracle, tiny
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.fast.compute.attention import engine_attention
from specbatch.fast.engine import Clock, Settings, Stats
from specbatch.fast.models import ModelRunner, mask_fill_value
from specbatch.fast.observer import InvariantChecker
from specbatch.fast.strategies.ragged import RaggedEngine
from specbatch.reference import deviate_hashed
from profiles import examples

RNG = np.random.default_rng(5)
POOL = [RNG.integers(0, VOCAB, n).tolist() for n in (1, 14, 3, 40, 7, 2, 25, 9)]
BUDGETS = [6, 3, 8, 5, 1, 7, 4, 6]
TARGET = tiny("llama")
WANT = oracle(TARGET, POOL, BUDGETS, [EOS])


class ManualArrivals:
    """Arrivals released by the state machine's `submit` rule."""

    def __init__(self, count):
        self.count, self.released, self.allowed = count, 0, 0

    def due(self):
        out = list(range(self.released, self.allowed))
        self.released = self.allowed
        return out

    def pending(self):
        return self.released < self.count

    def wait(self):
        pass


class RaggedMachine(RuleBasedStateMachine):
    @initialize(slots=st.integers(1, 4), k=st.integers(1, 5), seed=st.integers(0, 50))
    def setup(self, slots, k, seed):
        self.settings = Settings(k=k, eos_ids=(EOS,), window=None, dtype=torch.float64, device=torch.device("cpu"),
                                 fill=mask_fill_value(torch.float64), observer=InvariantChecker())
        self.arrivals = ManualArrivals(len(POOL))
        self.settings.arrivals = self.arrivals
        stats = Stats()
        self.attention = engine_attention(TARGET)  # the engine's attention, as generate() sets it up
        self.attention.__enter__()
        self.engine = RaggedEngine(ModelRunner(TARGET), ModelRunner(ScriptedDraft(TARGET, deviate_hashed(seed, 0.3))),
                                   POOL, BUDGETS, self.settings, stats, Clock(stats, self.settings.device), slots)
        self.done, self.rounds = {}, 0

    def teardown(self):
        if hasattr(self, "attention"):
            self.attention.__exit__(None, None, None)

    @precondition(lambda self: hasattr(self, "arrivals") and self.arrivals.allowed < len(POOL))
    @rule(count=st.integers(1, 3))
    def submit(self, count):
        self.arrivals.allowed = min(len(POOL), self.arrivals.allowed + count)

    @precondition(lambda self: hasattr(self, "engine") and (self.arrivals.allowed > len(self.done)))
    @rule()
    def round(self):
        if self.engine.step(self.rounds + 1, lambda r, tokens, reason, n: self.done.setdefault(r, tokens)):
            self.rounds += 1
            ran = self.engine.last_round
            assert ran["slots"] == list(range(len(ran["slots"])))  # the running rows were slots 0..R-1
            if ran["queued"]:  # requests waited, so the round ran with every slot
                assert len(ran["slots"]) == self.engine.slots

    @rule()
    def idle(self):
        """Nothing happens (keeps the machine runnable once every request is done)."""

    @invariant()
    def finished_requests_are_exact(self):
        if not hasattr(self, "engine"):
            return
        for r, tokens in self.done.items():
            assert tokens == WANT[r], r


RaggedMachine.TestCase.settings = settings(max_examples=examples(4), stateful_step_count=15, deadline=None)
TestRaggedEngine = RaggedMachine.TestCase

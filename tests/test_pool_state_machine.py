"""Rule-based state machines for the schedulers: S1 (conservation), S2, S3 (bounded waiting)."""
import math

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specbatch.invariants import check_conservation, check_liveness
from specbatch.reference import ExspecPool, SlotQueue


class ExspecPoolMachine(RuleBasedStateMachine):
    @initialize(batch=st.integers(1, 6), window_factor=st.integers(1, 5), max_wait=st.integers(0, 5),
                fraction=st.sampled_from([0.0, 0.5, 1.0]))
    def setup(self, batch, window_factor, max_wait, fraction):
        self.pool = ExspecPool(batch, window=batch * window_factor, max_wait=max_wait, min_group_fraction=fraction)
        self.submitted, self.keys, self.waits = [], {}, {}

    @rule(count=st.integers(1, 4))
    def submit(self, count):
        for _ in range(count):
            r = len(self.submitted)
            self.submitted.append(r)
            self.pool.submit(r)

    @precondition(lambda self: self.pool.queue or self.pool.pool)
    @rule(data=st.data())
    def round(self, data):
        for r in self.pool.admit():
            self.keys[r] = (data.draw(st.integers(1, 4)), 1, 1)
            self.pool.enter(r, self.keys[r])
        chosen, grouped = self.pool.select()
        assert 0 < len(chosen) <= self.pool.batch_size
        if grouped:
            assert len({self.keys[r] for r in chosen}) == 1  # a group never needs realignment
        assert check_conservation(self.submitted, self.pool.members()) == []
        finished = {r for r in chosen if data.draw(st.booleans())}
        for r in chosen:
            self.keys[r] = (self.keys[r][0] + data.draw(st.integers(1, 3)), 1, data.draw(st.integers(1, 2)))
        for r in self.pool.pool:
            self.waits[r.request] = r.waited
        self.pool.finish_round(self.keys, finished)

    @invariant()
    def conserved_and_bounded(self):
        if not hasattr(self, "pool"):
            return
        assert check_conservation(self.submitted, self.pool.members()) == []
        bound = self.pool.max_wait + math.ceil(self.pool.window / self.pool.batch_size)
        assert check_liveness(self.waits, bound) == []
        arrival = [self.pool.arrival[r.request] for r in self.pool.pool]
        assert arrival == sorted(arrival)  # seniority order kept


class SlotQueueMachine(RuleBasedStateMachine):
    @initialize(slots=st.integers(1, 6))
    def setup(self, slots):
        self.slots = SlotQueue(slots)
        self.submitted, self.waited = [], {}

    @rule(count=st.integers(1, 4))
    def submit(self, count):
        for _ in range(count):
            r = len(self.submitted)
            self.submitted.append(r)
            self.slots.submit(r)

    @rule(data=st.data())
    def round(self, data):
        self.slots.refill()
        if self.slots.queue:  # the batch stays full while requests remain
            assert all(o >= 0 for o in self.slots.owner)
        before = list(self.slots.owner)
        moves = self.slots.compact()
        running = [r for r in self.slots.owner if r >= 0]
        assert sorted(running) == sorted(r for r in before if r >= 0)  # nobody lost, nobody added
        assert self.slots.owner[:len(running)] == running  # the running rows are slots 0..R-1
        assert len(moves) == sum(o < 0 for o in before[:len(running)])  # one move per hole below the top
        for src, dst in moves:
            assert before[src] >= 0 and dst < src
            assert self.slots.owner[dst] == before[src]
        for slot, owner in enumerate(self.slots.owner):
            if owner >= 0 and data.draw(st.booleans()):
                self.slots.release(slot)

    @invariant()
    def conserved(self):
        if hasattr(self, "slots"):
            assert check_conservation(self.submitted, self.slots.members()) == []
            running = [r for r in self.slots.owner if r >= 0]
            assert sorted(running + self.slots.done + self.slots.queue) == self.submitted
            assert self.slots.queue == sorted(self.slots.queue)  # FIFO


TestExspecPool = ExspecPoolMachine.TestCase
TestSlotQueue = SlotQueueMachine.TestCase

"""Token trees in the reference (reference.trees): layout, tree mask and positions, greedy path
acceptance and the path's K/V move, against target-only greedy decoding and the invariant checks."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from profiles import examples
from reference_cases import TARGET, VOCAB, cases
from specbatch.invariants import InvariantError, check_tree_forward
from specbatch.reference import greedy_decode
from specbatch.reference import trees as tree_module
from specbatch.reference.rounds import greedy_accept
from specbatch.reference.state import RaggedState
from specbatch.reference.trees import Tree, forward_tree, greedy_path, random_tree, best_first_tree, tree_generate


class SecondGuessDraft:
    """The target, softened by `temperature`, with its two best tokens swapped where `every` divides
    the predicted index: a draft whose first guess is wrong there and whose second guess is right."""

    def __init__(self, base, every: int, temperature: float = 8.0):
        self.base, self.every, self.temperature = base, every, temperature

    def logits_of(self, sequence, window=None):
        logits = self.base.logits_of(sequence, window) / self.temperature
        for t in range(len(sequence)):
            if (t + 1) % self.every == 0:
                first, second = np.argsort(-logits[t], kind="stable")[:2]
                logits[t, [first, second]] = logits[t, [second, first]]
        return logits


def target_likely(content, window=None):
    """The target's greedy next token after content + a path's tokens (path[0] is the root)."""
    return lambda path: int(TARGET.logits_of(list(content) + list(path[1:]), window)[-1].argmax())


def test_a_tree_knows_its_depths_ancestors_and_paths():
    #        0
    #      1   2
    #     3 4   5
    #           6
    tree = Tree(np.array([9, 1, 2, 3, 4, 5, 6]), np.array([-1, 0, 0, 1, 1, 2, 5]))
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.path_to(6) == [2, 5, 6] and tree.path_to(0) == []
    assert tree.children(1).tolist() == [3, 4]
    anc = tree.ancestors()
    assert np.nonzero(anc[6])[0].tolist() == [0, 2, 5, 6]
    assert np.nonzero(anc[4])[0].tolist() == [0, 1, 4]
    assert not anc[3, 4] and not anc[1, 2]  # siblings never see each other
    chain = Tree.chain(9, [4, 5, 6])
    assert chain.parent.tolist() == [-1, 0, 1, 2] and chain.depth.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("tokens, parent, words", [
    ([1, 2], [-1, 1], "parents must come first"),
    ([1, 2, 3], [-1, 0, 2], "parents must come first"),
    ([1, 2], [0, 0], "parents must come first"),
    ([1, 2, 2], [-1, 0, 0], "carry a token twice"),
    ([], [], "one token and one parent"),
    ([1, 2], [-1], "one token and one parent"),
])
def test_a_malformed_tree_is_refused_by_name(tokens, parent, words):
    with pytest.raises(ValueError, match=words):
        Tree(np.array(tokens, dtype=np.int64), np.array(parent, dtype=np.int64))


@given(st.data())
@settings(max_examples=examples(60), deadline=None)
def test_greedy_path_on_a_chain_is_greedy_accept(data):
    k = data.draw(st.integers(0, 6))
    drafted = np.array(data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k)), dtype=np.int64)
    choice = np.array(data.draw(st.lists(st.integers(0, 3), min_size=k + 1, max_size=k + 1)), dtype=np.int64)
    path = greedy_path(Tree.chain(7, drafted), choice)
    assert path == list(range(1, len(path) + 1))
    assert len(path) == greedy_accept(drafted[None], choice[None], np.array([k]))[0]


def test_greedy_path_follows_the_sibling_the_target_chose():
    tree = Tree(np.array([9, 4, 5, 6, 7]), np.array([-1, 0, 0, 2, 2]))
    assert greedy_path(tree, np.array([5, 0, 7, 0, 1])) == [2, 4]  # root chose 5 (node 2), node 2 chose 7 (node 4)
    assert greedy_path(tree, np.array([4, 0, 0, 0, 0])) == [1]
    assert greedy_path(tree, np.array([3, 0, 0, 0, 0])) == []


@given(case=cases(max_batch=6, max_prompt=20), data=st.data())
@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_trees_per_row_give_target_only_greedy_output(case, data):
    """Random tree shapes and acceptance paths, a different tree per row per round, uneven prompts,
    EOS sets, pad == eos, per-row budgets and sliding windows: the output is greedy_decode's and
    every round keeps I2, I4 (tree mask) and I3 (only the path's K/V in the cache)."""
    window = data.draw(st.sampled_from([None, 1, 3, 8]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    max_nodes = data.draw(st.integers(0, 10))

    def propose(content):
        return random_tree(rng, content[-1], int(rng.integers(0, max_nodes + 1)), VOCAB, target_likely(content, window))
    result = tree_generate(TARGET, case["prompts"], propose, case["max_new_tokens"], case["eos_ids"], case["pad_id"],
                           window, check_invariants=True)
    budgets = case["max_new_tokens"] if isinstance(case["max_new_tokens"], list) else \
        [case["max_new_tokens"]] * len(case["prompts"])
    for prompt, budget, got, reason in zip(case["prompts"], budgets, result.sequences, result.stop_reasons):
        want = greedy_decode(TARGET, prompt, budget, case["eos_ids"], window)
        assert got == want
        assert reason == ("eos" if want and want[-1] in case["eos_ids"] else "length")


def test_a_tree_accepts_the_second_guess_a_chain_misses():
    """Where the draft's first guess is wrong and its second right, branching 2 accepts more per
    round than the chain of the same size, and both give target-only greedy output."""
    draft = SecondGuessDraft(TARGET, every=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    accepted = {}
    for branch in (1, 2):
        result = tree_generate(TARGET, prompts, lambda c: best_first_tree(draft, c, 8, branch), 16, check_invariants=True)
        assert result.sequences == [greedy_decode(TARGET, p, 16) for p in prompts]
        accepted[branch] = np.mean(result.stats["accepted"])
    assert accepted[2] > accepted[1] + 0.5, accepted


def test_the_target_as_its_own_draft_accepts_its_greedy_path():
    """A draft equal to the target accepts the deepest path its tree holds along the target's greedy
    continuation, and the tree holds exactly `nodes` nodes."""
    result = tree_generate(TARGET, [[1, 2, 3], [5]], lambda c: best_first_tree(TARGET, c, 6, 2), 12,
                           check_invariants=True)
    assert result.stats["nodes"][:2] == [6, 6]
    assert min(result.stats["accepted"][:2]) >= 1
    chain = tree_generate(TARGET, [[1, 2, 3], [5]], lambda c: best_first_tree(TARGET, c, 6, 1), 12)
    assert chain.stats["accepted"][:2] == [6, 6]


def _verify(trees, content, window=None):
    capacity = 16
    cache = [(np.random.default_rng(0).normal(size=(len(trees), capacity, TARGET.dim)),) * 2
             for _ in range(TARGET.n_layers)]
    return forward_tree(TARGET, cache, np.arange(len(trees)), trees, np.asarray(content), window, 0), capacity


@pytest.mark.parametrize("window", [None, 2])
def test_the_tree_checker_accepts_the_forward_and_names_each_broken_entry(window):
    trees = [Tree(np.array([3, 4, 5, 6]), np.array([-1, 0, 0, 1])), Tree.chain(2, [7])]
    (_, _, seen), capacity = _verify(trees, [5, 3], window)
    parents = [t.parent for t in trees]
    assert check_tree_forward(seen["positions"], seen["allowed"], [5, 3], parents, capacity, window) == []

    sibling = seen["allowed"].copy()
    sibling[0, 2, capacity + 1] = True  # node 2 sees its sibling, node 1
    found = check_tree_forward(seen["positions"], sibling, [5, 3], parents, capacity, window)
    assert [(v.invariant, v.row, v.index) for v in found] == [("I4", 0, capacity + 1)]

    by_index = seen["positions"].copy()
    by_index[0, :4] = 5 - 1 + np.arange(4)  # positions from the node index, not the depth
    found = check_tree_forward(by_index, seen["allowed"], [5, 3], parents, capacity, window)
    assert [(v.invariant, v.index) for v in found] == [("I2", 2), ("I2", 3)]

    stale = seen["allowed"].copy()
    stale[1, 1, 2] = True  # row 1's node sees slot 2, its pending token's slot, which holds nothing yet
    found = check_tree_forward(seen["positions"], stale, [5, 3], parents, capacity, window)
    assert [(v.invariant, v.row) for v in found] == [("I4", 1)]


def test_a_node_gets_the_logits_of_its_own_path_and_nothing_from_siblings():
    content = [1, 2, 3, 4]
    tree = Tree(np.array([4, 7, 8, 9]), np.array([-1, 0, 0, 2]))
    capacity = 12
    state_cache = [(np.zeros((1, capacity, TARGET.dim)), np.zeros((1, capacity, TARGET.dim)))
                   for _ in range(TARGET.n_layers)]
    for (keys, values), (k, v) in zip(state_cache, TARGET.kv_of(content[:-1])):
        keys[0, :3], values[0, :3] = k, v
    logits, _, _ = forward_tree(TARGET, state_cache, np.array([0]), [tree], np.array([4]), None, 0)
    for node in range(tree.size):
        sequence = content + [int(t) for t in tree.tokens[tree.path_to(node)]]
        np.testing.assert_allclose(logits[0, node], TARGET.logits_of(sequence)[-1], rtol=1e-9, atol=1e-9)


def test_keeping_a_node_off_the_path_breaks_i3(monkeypatch):
    """The K/V move is checked: keeping nodes in index order instead of along the path leaves a
    sibling's K/V in the cache, and the round's I3 check names it."""
    def keep_in_index_order(cache, rows, new_kv, paths, content):
        for i, (row, path) in enumerate(zip(rows, paths)):
            nodes = list(range(len(path) + 1))
            slots = content[i] - 1 + np.arange(len(nodes))
            for (keys, values), (k_new, v_new) in zip(cache, new_kv):
                keys[row, slots], values[row, slots] = k_new[i, nodes], v_new[i, nodes]

    def wrong_first(content):  # node 1 a wrong token, node 2 the target's, node 3 the target's next
        first = target_likely(content)([content[-1]])
        second = target_likely(content)([content[-1], first])
        return Tree(np.array([content[-1], (first + 1) % VOCAB, first, second]), np.array([-1, 0, 0, 2]))
    assert tree_generate(TARGET, [[1, 2, 3]], wrong_first, 10, check_invariants=True).stats["accepted"][0] == 2
    monkeypatch.setattr(tree_module, "keep_path", keep_in_index_order)
    with pytest.raises(InvariantError, match="I3"):
        tree_generate(TARGET, [[1, 2, 3]], wrong_first, 10, check_invariants=True)


def test_a_tree_not_rooted_at_the_pending_token_is_refused():
    state = RaggedState.empty(1, 8)
    state.tokens[0, :3], state.content_len[0], state.budget_end[0], state.request[0] = [1, 2, 3], 3, 8, 0
    cache = [(np.zeros((1, 8, TARGET.dim)), np.zeros((1, 8, TARGET.dim))) for _ in range(TARGET.n_layers)]
    with pytest.raises(ValueError, match="pending token"):
        tree_module.tree_round(state, cache, np.array([0]), TARGET, [Tree.chain(2, [5])], (), None, 0)

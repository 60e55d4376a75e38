"""The torch engine's tree verify (fast.layout.TreeLayout, fast.compute.attention.tree_visibility,
fast.verify.greedy_tree_path, SlotCache.keep_path) against its specification, reference.trees: one
flat forward over every row's tree gives each node the logits of its own sequence computed from
scratch by transformers, the accepted path is the reference's, and after the path's K/V move each
row's cache holds a fresh prefill's K/V of its new content (I3)."""
import numpy as np
import pytest
import torch

from hf_models import VOCAB, tiny
from specbatch.fast.compute.attention import engine_attention, flat_plan
from specbatch.fast.compute.prefill import prefill_into
from specbatch.fast.compute.slot_cache import SlotCache
from specbatch.fast.engine import Settings, check_cache_row
from specbatch.fast.layout import TreeLayout, VerifyLayout
from specbatch.fast.models import ModelRunner, attention_window, mask_fill_value
from specbatch.fast.verify import greedy_tree_path
from specbatch.reference.trees import Tree, greedy_path, random_tree

DOUBLE = torch.float64


def scratch_logits(model, sequence):
    """The model's last logits over an unpadded sequence, batch 1, no cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([sequence]), use_cache=False).logits[0, -1]


def tree_verify(model, contents, trees, window):
    """One engine tree verify: prefill content[:-1] of each row into a SlotCache, then one flat
    forward over every row's tree. Returns (runner, settings, cache, layout, logits [N, V])."""
    runner = ModelRunner(model)
    settings = Settings(k=0, eos_ids=(), window=window, dtype=DOUBLE, device=torch.device("cpu"),
                        fill=mask_fill_value(DOUBLE))
    capacity = max(len(c) + t.size for c, t in zip(contents, trees)) + 1
    cache = SlotCache(runner.num_layers, len(contents), capacity, settings.device)
    layout = TreeLayout.of([t.parent for t in trees], [len(c) for c in contents])
    with engine_attention(model):
        prefill_into(runner, cache, [c[:-1] for c in contents], list(range(len(contents))), [0] * len(contents),
                     settings)
        plan = flat_plan(layout.token_row, layout.token_index, window, DOUBLE, settings.fill, settings.device,
                         layout.position, layout.ancestors)
        cache.prepare_flat(torch.as_tensor(layout.token_row), torch.as_tensor(layout.token_index), len(contents),
                           int(layout.token_index.max()) + 1)
        ids = torch.as_tensor(np.concatenate([t.tokens for t in trees]))[None]
        hidden = torch.full((1, 1, 1, 1), settings.fill, dtype=DOUBLE).expand(1, 1, layout.tokens, cache.kv_len)
        logits = runner(ids, torch.as_tensor(layout.position)[None], hidden, cache, flat=plan)[0]
    return runner, settings, cache, layout, logits


def test_a_chain_tree_has_the_chain_layout():
    chain = TreeLayout.of([np.arange(-1, 3), np.arange(-1, 1), np.array([-1])], [5, 3, 7])
    flat = VerifyLayout.of(proposed=[3, 1, 0], content=[5, 3, 7])
    for name in ("token_row", "column", "token_index", "gather"):
        assert np.array_equal(getattr(chain, name), getattr(flat, name)), name
    assert np.array_equal(chain.position, flat.token_index)


def test_tree_layout_positions_slots_and_ancestors():
    layout = TreeLayout.of([np.array([-1, 0, 0, 2]), np.array([-1, 0])], [6, 2])
    assert layout.token_row.tolist() == [0, 0, 0, 0, 1, 1]
    assert layout.token_index.tolist() == [5, 6, 7, 8, 1, 2]  # scratch slot c - 1 + node
    assert layout.position.tolist() == [5, 6, 6, 7, 1, 2]  # c - 1 + depth
    assert layout.ancestors[3].tolist() == [True, False, True, True]
    assert layout.ancestors[5].tolist() == [True, True, False, False]
    assert layout.gather.tolist() == [[0, 1, 2, 3], [4, 5, 5, 5]]


@pytest.mark.parametrize("arch, window", [("llama", None), ("qwen3", None), ("gpt2", None), ("mistral", 3)])
def test_one_tree_verify_gives_every_node_its_own_logits_and_keeps_only_the_path(arch, window):
    overrides = dict(sliding_window=window) if window else {}
    model = tiny(arch, **overrides)
    assert attention_window(model)[0] == window
    rng = np.random.default_rng(5)
    contents = [rng.integers(0, VOCAB, n).tolist() for n in (6, 2, 11, 4)]

    def likely_after(content):
        return lambda path: int(scratch_logits(model, content + list(path[1:])).argmax())
    trees = [random_tree(rng, c[-1], int(rng.integers(0, 9)), VOCAB, likely_after(c)) for c in contents]
    contents.append(rng.integers(0, VOCAB, 7).tolist())  # a sibling first, then a path of depth 4 under the
    trees.append(Tree(np.array([contents[-1][-1], 1, 2, 3, 4, 5]), np.array([-1, 0, 0, 2, 3, 4])))  # other one
    runner, settings, cache, layout, logits = tree_verify(model, contents, trees, window)

    for i, (content, tree) in enumerate(zip(contents, trees)):
        for node in range(tree.size):
            sequence = content + [int(t) for t in tree.tokens[tree.path_to(node)]]
            torch.testing.assert_close(logits[layout.start[i] + node], scratch_logits(model, sequence),
                                       rtol=1e-9, atol=1e-9)

    choice = logits.argmax(-1)[torch.as_tensor(layout.gather)]  # [R, W]
    tokens = torch.as_tensor(np.concatenate([t.tokens for t in trees]))[torch.as_tensor(layout.gather)]
    path, accepted = greedy_tree_path(choice, tokens, torch.as_tensor(layout.parent), torch.as_tensor(layout.size))
    want = [greedy_path(t, choice[i].numpy()) for i, t in enumerate(trees)]
    assert [path[i, :accepted[i]].tolist() for i in range(len(trees))] == want
    assert sum(map(len, want)) >= 2  # paths were accepted, not only rejected

    source = torch.where(path >= 0, torch.as_tensor(layout.content - 1)[:, None] + path, cache.capacity)
    target = torch.where(path >= 0, torch.as_tensor(layout.content)[:, None] + torch.arange(path.shape[1]),
                         cache.capacity)
    cache.keep_path(torch.arange(len(trees)), source, target)
    for i, (content, tree) in enumerate(zip(contents, trees)):
        nodes = [0] + want[i]
        committed = [int(choice[i, node]) for node in nodes]
        prefix = content + committed[:-1]  # the new content but its pending token
        found = check_cache_row(runner, lambda layer: cache.slot_values(layer, i, len(prefix)), i, prefix, 0,
                                settings, "target cache")
        assert found == [], found[:2]


def test_a_sibling_never_reaches_a_node_and_the_checker_agrees():
    """The plan's tree masks pass invariants.check_tree_forward, and hide siblings: changing a
    sibling's token leaves its neighbour's logits as they were."""
    from specbatch.invariants import check_tree_forward
    model = tiny("llama")
    content = [3, 4, 5, 6]
    tree_a = Tree(np.array([6, 10, 11, 12]), np.array([-1, 0, 0, 1]))
    tree_b = Tree(np.array([6, 10, 20, 12]), np.array([-1, 0, 0, 1]))  # node 2 differs
    _, settings, cache, layout, logits_a = tree_verify(model, [content], [tree_a], None)
    _, _, _, _, logits_b = tree_verify(model, [content], [tree_b], None)
    torch.testing.assert_close(logits_a[[0, 1, 3]], logits_b[[0, 1, 3]], rtol=0, atol=0)
    assert not torch.equal(logits_a[2], logits_b[2])
    plan = flat_plan(layout.token_row, layout.token_index, None, DOUBLE, settings.fill, settings.device,
                     layout.position, layout.ancestors)
    (part,) = plan
    capacity = part.length
    allowed = (part.mask[:, 0] == 0).numpy()  # [1, Q, length]: slots, the tree's scratch slots among them
    tree_slots = allowed[:, :, 3:3 + tree_a.size]  # the root's slot c - 1 = 3 on
    mask = np.concatenate([allowed[:, :, :3], np.zeros((1, tree_a.size, capacity - 3), bool), tree_slots], axis=2)
    assert check_tree_forward(layout.position[None], mask, [4], [tree_a.parent], capacity, None) == []

"""Microbenchmarks of the EQSPEC realignment (one gather per cache tensor) against a per-row
unpad/repad loop, for batch 1-32 and width 256/1024. Benchmarks are disabled in the default run
(each body runs once, with its assertion); time them with:
    python -m pytest tests/test_bench_realign.py --benchmark-enable --benchmark-group-by=param:batch
"""
import numpy as np
import pytest
import torch
from transformers import DynamicCache

from specbatch.fast.compute.cache import gather_cache
from specbatch.reference import realign_source

LAYERS, HEADS, DIM = 4, 3, 64  # a small model's cache shape; bytes scale linearly with each


def make_cache(batch, width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(LAYERS):
        cache.update(torch.randn(batch, HEADS, width, DIM, generator=gen),
                     torch.randn(batch, HEADS, width, DIM, generator=gen), layer)
    return cache


def realign_case(batch, width, k=4, seed=0):
    """Content lengths near `width`, per-row commit counts, and the δ source map."""
    rng = np.random.default_rng(seed)
    content = rng.integers(1, width - k - 1, batch)
    content[0] = width - k - 1  # the longest row defines L
    n = rng.integers(1, k + 2, batch)
    old_width = int(content.max())
    new_width = int((content + n).max())
    return content, n, old_width, new_width, realign_source(old_width - content, n, old_width, new_width)


def per_row_loop(cache, source, width):
    """The naive alternative: unpad and repad each row separately, then stack."""
    for layer in cache.layers:
        rows_k, rows_v = [], []
        for i in range(source.shape[0]):
            idx = source[i, :width].clamp(min=0)
            rows_k.append(layer.keys[i].index_select(1, idx))
            rows_v.append(layer.values[i].index_select(1, idx))
        layer.keys, layer.values = torch.stack(rows_k), torch.stack(rows_v)


def plain_copy(cache):
    """The lower bound to compare with: copy every tensor once (this is not a realignment)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()


@pytest.mark.parametrize("width", [256, 1024])
@pytest.mark.parametrize("batch", [1, 4, 8, 16, 32])
@pytest.mark.parametrize("method", ["gather", "per_row_loop", "copy"])
def test_realign(benchmark, method, batch, width):
    content, n, old_width, new_width, source = realign_case(batch, width)
    source_t = torch.as_tensor(source).clamp(min=0)
    row = batch - 1
    old_slot = old_width - content[row] + content[row] + n[row] - 2  # its last cached content index, old column
    realign = {"gather": lambda c: gather_cache(c, None, source_t, new_width - 1),
               "per_row_loop": lambda c: per_row_loop(c, source_t, new_width - 1),
               "copy": plain_copy}[method]

    def setup():  # the verify forward left k + 1 more slots after the old width
        return (make_cache(batch, old_width + 5),), {}

    if benchmark.enabled:
        benchmark.pedantic(realign, setup=setup, rounds=5, iterations=1)
    cache = setup()[0][0]
    want = cache.layers[0].keys[row, :, old_slot].clone()
    before = [(layer.keys, layer.keys.clone()) for layer in cache.layers]
    realign(cache)
    if method == "copy":  # the baseline really copies every tensor: new storage, same values
        for layer, (old, saved) in zip(cache.layers, before):
            assert layer.keys.data_ptr() != old.data_ptr() and torch.equal(layer.keys, saved)
        return
    assert cache.layers[0].keys.shape == (batch, HEADS, new_width - 1, DIM)
    assert torch.equal(cache.layers[0].keys[row, :, -1], want)  # right-aligned: last slot = last content

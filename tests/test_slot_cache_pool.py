"""The slot caches' K/V buffers kept between generations (fast.compute.slot_cache.SparePool)."""
import pytest
import torch

import specbatch
from hf_models import EOS, oracle, tiny
from specbatch.fast.compute import slot_cache
from specbatch.fast.compute.slot_cache import SparePool


def test_a_given_back_buffer_is_handed_out_again_zeroed():
    pool = SparePool()
    keys, buffer = pool.take((2, 3, 5, 4), torch.float32, "cpu")
    assert keys.shape == (2, 3, 5, 4) and not keys.any()
    keys.fill_(float("nan"))
    pool.give([buffer])
    again, same = pool.take((2, 3, 4, 4), torch.float32, "cpu")  # smaller: the kept buffer fits
    assert same.data_ptr() == buffer.data_ptr() and again.shape == (2, 3, 4, 4)
    assert not again.isnan().any() and not again.any()  # the part handed out is zeroed


def test_buffers_in_use_are_never_handed_out_twice():
    pool = SparePool()
    first, a = pool.take((64,), torch.float32, "cpu")
    second, b = pool.take((64,), torch.float32, "cpu")
    assert a.data_ptr() != b.data_ptr()
    pool.give([a])
    third, c = pool.take((64,), torch.float32, "cpu")
    fourth, d = pool.take((64,), torch.float32, "cpu")
    assert c.data_ptr() == a.data_ptr() and d.data_ptr() not in (a.data_ptr(), b.data_ptr())


def test_the_smallest_fitting_buffer_of_the_dtype_is_taken():
    pool = SparePool()
    taken = [pool.take((n,), torch.float32, "cpu")[1] for n in (100, 40, 60)] + \
        [pool.take((50,), torch.float64, "cpu")[1]]
    pool.give(taken)
    assert pool.take((45,), torch.float32, "cpu")[1].data_ptr() == taken[2].data_ptr()  # 60, not 100 or 40
    assert pool.take((45,), torch.float64, "cpu")[1].data_ptr() == taken[3].data_ptr()
    assert pool.take((200,), torch.float32, "cpu")[1].numel() == 200  # none fits: a fresh one


def test_the_spares_never_hold_more_than_the_caches_held_at_once():
    pool = SparePool()
    small = [pool.take((100,), torch.float32, "cpu")[1] for _ in range(3)]
    pool.give(small)  # peak 1,200 bytes
    big = pool.take((250,), torch.float32, "cpu")[1]  # nothing fits; 1,000 bytes in use, spares 1,200
    pool.give([big])  # 2,200 bytes of spares against a peak of 1,200: the small ones go first
    assert pool.peak == 1200 and sum(b.numel() * 4 for b in pool.spare) <= pool.peak
    assert any(b.data_ptr() == big.data_ptr() for b in pool.spare)
    assert pool.clear() > 0 and pool.spare == []


def _prompts():
    return [[5, 9, 2, 7, 3, 11, 4, 8, 6, 1, 12, 13], [3, 4], [7, 1, 9, 2, 5]]  # lengths differ: masked slots are read


def test_a_generation_gives_its_buffers_back_and_the_next_one_reuses_them():
    target, draft = tiny("llama"), tiny("llama", layers=1, seed=1)
    spares = slot_cache.SPARES
    spares.clear()
    before = spares.in_use  # caches other tests made themselves and never released
    first = specbatch.generate(target, draft, _prompts(), max_new_tokens=6, batch_size=3, strategy="ragged")
    kept = {b.data_ptr() for b in spares.spare}
    assert kept and spares.in_use == before  # the target's and the draft's buffers are back
    second = specbatch.generate(target, draft, _prompts(), max_new_tokens=6, batch_size=3, strategy="ragged")
    assert {b.data_ptr() for b in spares.spare} == kept  # the same buffers served the second generation
    assert specbatch.release_buffers() > 0 and spares.spare == []
    assert second.sequences == first.sequences == oracle(target, _prompts(), 6, [EOS])


@pytest.mark.parametrize("strategy", ["ragged", "eqspec"])
def test_stale_or_poisoned_spares_change_no_output(strategy):
    """Every kept buffer filled with NaN before a generation: the buffers it is handed are zeroed,
    so slots no forward wrote (read under the mask by shorter rows) cannot leak into any output."""
    target, draft = tiny("llama"), tiny("llama", layers=1, seed=1)
    specbatch.generate(target, draft, _prompts(), max_new_tokens=6, batch_size=3, strategy="ragged")
    assert slot_cache.SPARES.spare
    with torch.inference_mode():  # the buffers were made inside a forward's inference mode
        for buffer in slot_cache.SPARES.spare:
            buffer.fill_(float("nan"))
    got = specbatch.generate(target, draft, _prompts(), max_new_tokens=6, batch_size=3, strategy=strategy)
    assert got.sequences == oracle(target, _prompts(), 6, [EOS])

"""The step path's shared constants: right values, and memory that does not grow with the shapes asked for."""

import gc
import weakref

import torch

from vllm_ddtree.tree import constants


def test_ranges_are_views_of_one_range_that_grows_to_the_longest(monkeypatch):
    monkeypatch.setattr(constants, "_RANGES", {})  # as a fresh process starts
    cpu = torch.device("cpu")
    assert constants.arange(5, cpu, start=2).tolist() == [2, 3, 4]
    small = constants.arange(10, cpu)
    assert constants.arange(10, cpu) is small  # the view itself is kept: no dispatch the second time
    first = constants._FIRST_RANGE
    long = constants.arange(first + 5, cpu)  # past the first range: a longer one replaces it
    assert torch.equal(long, torch.arange(first + 5)) and small.tolist() == list(range(10))  # the old view stays valid
    again = constants.arange(7, cpu)
    assert again.untyped_storage().data_ptr() == long.untyped_storage().data_ptr()
    assert constants.arange(7, cpu) is again
    assert long.untyped_storage().nbytes() == 2 * first * 8  # doubled once: bounded by twice the longest


def test_filled_blocks_are_one_scalar_expanded_whatever_the_shape():
    cpu = torch.device("cpu")
    blocks = [constants.filled((r, 7), -1, torch.int64, cpu) for r in range(1, 300)]
    assert constants.filled((3, 7), -1, torch.int64, cpu) is blocks[2]  # kept: no dispatch the second time
    assert all(b.stride() == (0, 0) and b.untyped_storage().nbytes() == 8 for b in blocks)
    assert torch.equal(blocks[2], torch.full((3, 7), -1))
    # out-of-place writes make a block of their own and leave the constant as it was
    written = blocks[1].scatter(1, torch.tensor([[0], [3]]), torch.tensor([[5], [6]]))
    assert written.tolist() == [[5, -1, -1, -1, -1, -1, -1], [-1, -1, -1, 6, -1, -1, -1]]
    assert constants.filled((2, 7), -1, torch.int64, cpu).tolist() == [[-1] * 7] * 2


def test_memory_under_a_constant_outlives_its_kept_views(monkeypatch):
    # A captured CUDA graph reads a constant by its address, without a reference to it: a range that
    # grew, or a scalar whose kept views were dropped, must not be freed (the allocator would hand its
    # memory to another tensor, and a replay would read that one's values).
    monkeypatch.setattr(constants, "_RANGES", {})
    monkeypatch.setattr(constants, "_OUTGROWN", [])
    cpu = torch.device("cpu")
    first = weakref.ref(constants.arange(10, cpu)._base)
    constants.arange(constants._FIRST_RANGE + 1, cpu)  # grown: a longer range replaces the first
    # values no other code asks for: a constant another test made first (inside a make_fx trace, say)
    # would be that one's, not this test's
    scalar = weakref.ref(constants.filled((4, 4), 7771, torch.int16, cpu)._base)
    ints = weakref.ref(constants.device_ints((3, 1, 7771), cpu))
    for v in range(1100):  # more distinct constants than any bounded cache of them would keep
        constants.filled((1,), 1000 + v, torch.int64, cpu)
        constants.device_ints((1000 + v,), cpu)
    for cache in (constants._range_view, constants._expanded, constants._filled):
        cache.cache_clear()  # every kept view dropped, as the views' caches drop their oldest
    gc.collect()
    assert first() is not None and scalar() is not None and ints() is not None

"""The step path's shared constants: right values, and memory that does not grow with the shapes asked for."""

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

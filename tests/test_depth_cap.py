"""The proposer's depth cap: how many depths the drafter's LM head and the tree build cover."""

import pytest

pytest.importorskip("vllm")

from vllm_ddtree.proposer import DepthCap  # noqa: E402


def test_depth_cap_follows_the_realised_depth_and_doubles_when_reached():
    cap = DepthCap(width=15)
    assert cap.depth == 15  # before any tree: every depth the drafter predicts
    cap.observe(3)
    assert cap.depth == 6  # twice the deepest kept node
    cap.observe(6)  # a tree reached the cap: the next step may go twice as deep
    assert cap.depth == 12
    cap.observe(12)
    assert cap.depth == 15  # never beyond the drafter's width
    cap.observe(0)  # no tree this step (prefills only): the floor, not zero
    assert cap.depth == 2
    cap.observe(1)
    assert cap.depth == 2

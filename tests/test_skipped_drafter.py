"""A step whose drafter vLLM skipped (a request of the batch near max_model_len) schedules no drafts.

vLLM 0.32 then hands the scheduler zeros of ``num_speculative_tokens`` per request (gpu_model_runner.py
:4460): for ddtree, a chain of verify-width zeros for every request of the batch, each verified for
nothing. P13 hands no drafts instead. The runner is a stand-in with the attributes vLLM's
``take_draft_token_ids`` reads; the real engine's near-limit behaviour is in tests/test_vllm_ddtree.py.
"""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_ddtree import vllm_patches  # noqa: E402

vllm_patches.apply()

from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402


def stand_in(method: str, max_seq_len_room: int):
    spec = SimpleNamespace(method=method, ddtree=SimpleNamespace(drafter_width=15))
    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(speculative_config=spec), speculative_config=spec,
        effective_drafter_max_model_len=1024, num_spec_tokens=72, _draft_token_req_ids=["a", "b"],
        _draft_token_ids=[[0] * 72, [0] * 72], input_batch=SimpleNamespace(req_ids=["a", "b"]),
    )
    runner._get_draft_token_ids_cpu = lambda: GPUModelRunner._get_draft_token_ids_cpu(runner)
    return runner, SimpleNamespace(max_seq_len=1024 - max_seq_len_room)


@pytest.mark.parametrize("room, drafts", [(16, [[0] * 72, [0] * 72]), (15, [[], []])])
def test_a_skipped_drafter_leaves_no_drafts(room, drafts):
    """Room for the bonus token and W = 15 block rows: the drafter runs (its drafts pass through);
    one row less: it is skipped, and the scheduler gets no drafts rather than vLLM's zeros."""
    runner, metadata = stand_in("ddtree", room)
    fits = GPUModelRunner._input_fits_in_drafter(runner, metadata)
    assert fits == (room >= 16)
    out = GPUModelRunner.take_draft_token_ids(runner)
    assert out.req_ids == ["a", "b"] and out.draft_token_ids == drafts


def test_drafts_carry_their_trees_parents_to_the_scheduler():
    """The scheduler takes the trees' parents with the drafts (P16: structured outputs' masks per tree
    row), from the proposer's last trees, by request id."""
    import torch

    from vllm_ddtree.structured import DRAFT_PARENTS

    runner, _ = stand_in("ddtree", 16)
    runner.drafter = SimpleNamespace(proposed=SimpleNamespace(row_of={"b": 0, "a": 1},
                                                              parents=torch.tensor([[-1, 0, 0], [-1, -1, 1]])))
    trees = getattr(GPUModelRunner.take_draft_token_ids(runner), DRAFT_PARENTS)
    assert trees.of("a", 3) == [-1, -1, 1] and trees.of("b", 2) == [-1, 0]


def test_other_methods_keep_vllm_s_behaviour():
    runner, _ = stand_in("dflash", 0)
    runner._ddtree_drafter_skipped = True  # even if set, only ddtree configs are changed
    assert GPUModelRunner.take_draft_token_ids(runner).draft_token_ids == [[0] * 72, [0] * 72]

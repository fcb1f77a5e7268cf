"""The draft vocabulary's rows of the shared LM head (`DDTreeProposer._gather_vocab_head`).

A drafter that ships `draft_vocab.json` drafts over those ids only: at load the proposer gathers
their rows of the target's head into a layer of its own, run with the head's own GEMM method. The
gathered layer must give the head's logits on those ids; a head whose rows cannot be gathered as
plain floating-point rows must stop the start-up with the setting to change, not draft from
meaningless rows (the real engine with the toy drafter's head: tests/test_vllm_ddtree.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: E402

from vllm_ddtree.config import VOCAB_SUBSET_NEEDS_PLAIN_HEAD  # noqa: E402
from vllm_ddtree.proposer import DDTreeProposer  # noqa: E402

VOCAB, HIDDEN = 96, 16
IDS = torch.tensor([0, 3, 4, 17, 50, 95])  # the draft vocabulary: sorted target ids


def head(weight: torch.Tensor, method=None) -> torch.nn.Module:
    """A stand-in for vLLM's ParallelLMHead on one rank: its weight and its quant method."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.bias = None
    layer.quant_method = UnquantizedEmbeddingMethod() if method is None else method
    return layer


def proposer(ids: torch.Tensor = IDS) -> DDTreeProposer:
    p = DDTreeProposer.__new__(DDTreeProposer)  # only what the gather reads: no engine, no drafter
    p._vocab_ids = ids
    return p


def test_gathered_rows_give_the_head_s_logits_on_the_draft_ids():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    p = proposer()
    p._gather_vocab_head(head(weight))
    sub, method, ids, sharded = p._vocab_head
    assert sharded is None and torch.equal(ids, IDS)
    hidden = torch.randn(5, HIDDEN, generator=g)
    torch.testing.assert_close(method.apply(sub, hidden, bias=None), hidden @ weight[IDS].T)


@pytest.mark.parametrize("case", ["fp8 weight", "int8 weight", "no gemm method", "ids past the head"])
def test_heads_whose_rows_cannot_be_gathered_are_refused_naming_the_setting(case):
    weight = torch.randn(VOCAB, HIDDEN)
    layer = {
        # floating point too, but its rows mean nothing without the scales its method keeps
        "fp8 weight": lambda: head(weight.to(torch.float8_e4m3fn)),
        "int8 weight": lambda: head(weight.to(torch.int8)),
        "no gemm method": lambda: head(weight, method=object()),
        "ids past the head": lambda: head(weight[:50]),
    }[case]()
    with pytest.raises(ValueError) as info:
        proposer()._gather_vocab_head(layer)
    assert str(info.value) == VOCAB_SUBSET_NEEDS_PLAIN_HEAD and '"draft_vocab": "full"' in str(info.value)

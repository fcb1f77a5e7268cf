"""Grammar masks for draft trees (vllm_ddtree.structured): each row's mask is the grammar's state
after that row's own path, with vLLM's real xgrammar grammar and its own mask filling; under Qwen3's
reasoning parser, each row equals vLLM's own mask for that path drafted as one chain.

The engine-level check (greedy outputs token-identical to the target alone under json, regex and
choice constraints; sampled outputs inside the grammar) is in test_vllm_ddtree.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("vllm")

from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar  # noqa: E402

from vllm_ddtree.structured import TreeParents, fill_tree_rows, tree_paths  # noqa: E402

PATTERN = r"(yes please|yes sir|no thanks)\."


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_ddtree.models.target import prepare_target

    return AutoTokenizer.from_pretrained(prepare_target())


@pytest.fixture(scope="module")
def compiled(tokenizer):
    vocab = len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    return xgr.GrammarCompiler(info).compile_regex(PATTERN), vocab


def _grammar(compiled) -> XgrammarGrammar:
    ctx, vocab = compiled
    return XgrammarGrammar(matcher=xgr.GrammarMatcher(ctx, max_rollback_tokens=64), vocab_size=vocab, ctx=ctx)


def _manager(compiled, rows: int, bounds=None) -> SimpleNamespace:
    """vLLM's manager as `fill_tree_rows` uses it: its bitmask, its own `_fill_bitmasks`, and the
    constraint bounds (from the first token on, unless `bounds` stands in for a reasoning parser)."""
    manager = SimpleNamespace(_grammar_bitmask=xgr.allocate_token_bitmask(rows, compiled[1]),
                              _full_mask=torch.tensor(-1, dtype=torch.int32))
    manager._fill_bitmasks = StructuredOutputManager._fill_bitmasks.__get__(manager)
    manager._get_constraint_bounds = bounds or (lambda request, path: (0, 0))
    return manager


def _alone(compiled, path: list[int], grammar_start: int = 0, constrained: bool = True) -> torch.Tensor:
    """The mask a fresh grammar gives after `path` (fed from `grammar_start`; stopping at a token it
    rejects): what the target alone would be masked with after that text."""
    grammar = _grammar(compiled)
    mask = xgr.allocate_token_bitmask(1, compiled[1])
    for token in path[grammar_start:]:
        if not grammar.validate_tokens([token]):
            break
        grammar.accept_tokens("alone", [token])
    if constrained:
        grammar.fill_bitmask(mask, 0)
    else:
        mask.fill_(-1)
    return mask[0]


def _tree(tokenizer) -> tuple[list[int], list[int], list[list[int]]]:
    """A best-first tree over the pattern's words: two children of the root ("yes", "no"), their
    continuations, and a node the grammar rejects ("maybe") with a child of its own."""
    yes, please, sir = (tokenizer.encode(w)[0] for w in ("yes", " please", " sir"))
    no, thanks, maybe, dot = (tokenizer.encode(w)[0] for w in ("no", " thanks", "maybe", "."))
    tokens = [yes, no, please, maybe, sir, thanks, dot, dot]
    parents = [-1, -1, 0, -1, 0, 1, 2, 3]  # node 7 ("." after "maybe") hangs under a rejected node
    return tokens, parents, tree_paths(tokens, parents)


def test_each_row_is_masked_by_the_grammar_after_its_own_path(tokenizer, compiled):
    tokens, parents, paths = _tree(tokenizer)
    assert paths[4] == [tokens[0], tokens[4]] and paths[7] == [tokens[3], tokens[7]]
    manager, grammar = _manager(compiled, 1 + len(tokens)), _grammar(compiled)
    request = SimpleNamespace(request_id="r", structured_output_request=SimpleNamespace(grammar=grammar))
    assert fill_tree_rows(manager, request, tokens, parents, 0) == 1 + len(tokens)
    rows = manager._grammar_bitmask
    for row, path in enumerate([[]] + paths):
        assert torch.equal(rows[row], _alone(compiled, path)), f"row {row}, path {path}"
    # The rows really differ by path: after "yes" and after "no" the grammar allows other words, so a
    # chain's masks (row j after the first j drafts, vLLM's layout for one chain) are wrong for a tree.
    assert not torch.equal(rows[1], rows[2])
    chain = [_alone(compiled, tokens[:j]) for j in range(1 + len(tokens))]
    assert any(not torch.equal(rows[j], chain[j]) for j in range(1 + len(tokens)))
    # A rejected node (and its child) is masked as the row where the grammar stopped: the root's.
    assert torch.equal(rows[4], rows[0]) and torch.equal(rows[8], rows[0])
    # The grammar is left where it was: the next step starts from the committed text.
    assert grammar.num_processed_tokens == 0 and torch.equal(_alone(compiled, []), _row_now(compiled, grammar))


def _row_now(compiled, grammar) -> torch.Tensor:
    mask = xgr.allocate_token_bitmask(1, compiled[1])
    grammar.fill_bitmask(mask, 0)
    return mask[0]


def test_rows_follow_the_constraint_bounds_of_their_own_path(tokenizer, compiled):
    # A reasoning parser's bounds, as vLLM's `_get_constraint_bounds` gives them for a chain: the
    # grammar starts after an end token E; a path without E is not constrained (len + 1).
    end = tokenizer.encode("</think>")[0]
    yes, please = tokenizer.encode("yes")[0], tokenizer.encode(" please")[0]

    def bounds(request, path):
        if end in path:
            start = path.index(end) + 1
            return start, start
        return len(path) + 1, len(path) + 1

    tokens, parents = [end, yes, yes, please], [-1, 0, -1, 1]  # E -> yes -> please; yes (no E)
    manager, grammar = _manager(compiled, 5, bounds), _grammar(compiled)
    request = SimpleNamespace(request_id="r", structured_output_request=SimpleNamespace(grammar=grammar))
    fill_tree_rows(manager, request, tokens, parents, 0)
    rows = manager._grammar_bitmask
    full = torch.full_like(rows[0], -1)
    assert torch.equal(rows[0], full) and torch.equal(rows[3], full)  # the root; "yes" without E
    assert torch.equal(rows[1], _alone(compiled, [end], grammar_start=1))  # right after E: constrained
    assert torch.equal(rows[2], _alone(compiled, [end, yes], grammar_start=1))
    assert torch.equal(rows[4], _alone(compiled, [end, yes, please], grammar_start=1))
    assert not torch.equal(rows[1], full) and not torch.equal(rows[2], rows[1])


def test_parents_must_come_before_their_children():
    assert tree_paths([5, 6, 7], [-1, 0, 0]) == [[5], [5, 6], [5, 7]]
    with pytest.raises(ValueError, match="parent 2"):
        tree_paths([5, 6, 7], [-1, 2, 0])
    with pytest.raises(ValueError, match="3 draft tokens came with 2 parents"):
        tree_paths([5, 6, 7], [-1, 0])


def test_tree_parents_hand_each_request_its_prefix():
    trees = TreeParents({"a": 1, "b": 0}, torch.tensor([[-1, 0, 1, -1], [-1, -1, 0, 2]]))
    assert trees.of("a", 3) == [-1, -1, 0] and trees.of("b", 2) == [-1, 0]
    assert trees.of("c", 1) is None and trees.of("a", 5) is None


def test_rows_equal_vllm_s_own_chain_rows_for_each_path_under_qwen3_s_reasoning_parser():
    # The oracle is vLLM's own `grammar_bitmask` (unwrapped), run on each node's path as a one-chain
    # draft: its last row is what vLLM masks after that chain, the tree's row must be the same. The
    # request is still reasoning (Qwen3's engine parser): paths that close </think> are constrained
    # from the token after it, the others not at all, the root's row not.
    import inspect
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "engine"))
    from qwen3_shape import tokenizer_dir
    from transformers import AutoTokenizer
    from vllm.reasoning.qwen3_engine_reasoning_parser import Qwen3ParserReasoningAdapter

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    vocab = len(tok)
    ctx = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)).compile_regex(PATTERN)
    words = {w: tok.encode(w) for w in ("ok", "yes", " please", "no", " thanks", ".", " so")}
    assert all(len(ids) == 1 for ids in words.values()), words
    ok, yes, please, no, thanks, dot, so = (ids[0] for ids in words.values())
    end = tok.convert_tokens_to_ids("</think>")
    tokens = [ok, end, yes, please, no, end, no, thanks, dot, so]
    parents = [-1, 0, 1, 2, 1, -1, 5, 6, 7, 0]
    prompt = tok.encode("Say yes or no.") + [tok.convert_tokens_to_ids("<think>")]

    def manager(rows: int) -> SimpleNamespace:
        m = SimpleNamespace(
            enable_in_reasoning=False, reasoner_cls=Qwen3ParserReasoningAdapter, tokenizer=tok,
            fill_bitmask_parallel_threshold=128, _full_mask=torch.tensor(-1, dtype=torch.int32),
            _grammar_bitmask=xgr.allocate_token_bitmask(rows, vocab),
            backend=SimpleNamespace(allocate_token_bitmask=lambda n: xgr.allocate_token_bitmask(n, vocab)),
            vllm_config=SimpleNamespace(num_speculative_tokens=len(tokens), speculative_config=None,
                                        scheduler_config=SimpleNamespace(max_num_seqs=1),
                                        model_config=SimpleNamespace(is_diffusion=False)))
        for name in ("_fill_bitmasks", "_get_constraint_bounds", "_get_reasoner"):
            setattr(m, name, getattr(StructuredOutputManager, name).__get__(m))
        return m

    def request() -> SimpleNamespace:
        grammar = XgrammarGrammar(matcher=xgr.GrammarMatcher(ctx), vocab_size=vocab, ctx=ctx)
        return SimpleNamespace(request_id="r", use_structured_output=True, prompt_token_ids=prompt,
                               all_token_ids=list(prompt), structured_output_request=SimpleNamespace(
                                   grammar=grammar, reasoning_ended=None, reasoner=None, reasoning_parser_kwargs=None))

    tree_manager, tree_request = manager(1 + len(tokens)), request()
    fill_tree_rows(tree_manager, tree_request, tokens, parents, 0)
    rows = tree_manager._grammar_bitmask
    chain_bitmask = inspect.unwrap(StructuredOutputManager.grammar_bitmask)
    full = torch.full_like(rows[0], -1)
    for row, path in enumerate([[]] + tree_paths(tokens, parents)):
        chain = chain_bitmask(manager(1 + len(path)), {"r": request()}, ["r"], {"r": path})
        assert torch.equal(rows[row], torch.from_numpy(chain[-1])), f"row {row}, path {path}"
    assert torch.equal(rows[0], full) and torch.equal(rows[1], full) and torch.equal(rows[10], full)  # reasoning
    assert not torch.equal(rows[2], full) and not torch.equal(rows[3], rows[2])  # after </think>: the grammar

"""Fast checks of the DFlash drafter: block masking, KV cache, save/load round trip."""

from __future__ import annotations

import random

import torch

from vllm_ddtree.drafter import DFlashDrafter, DrafterConfig, DrafterKVCache, load_drafter, make_block, save_drafter
from vllm_ddtree.train.dflash import forward_batch, make_batch


def _tiny(draft_vocab: int = 40) -> tuple[DFlashDrafter, DrafterConfig]:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=64, draft_vocab_size=draft_vocab,
                        block_size=4, target_layer_ids=[0, 1], num_target_layers=4, mask_token_id=5)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size)
    m = DFlashDrafter(cfg, emb)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    m.d2t.copy_(torch.arange(draft_vocab) * 1 + 3 - torch.arange(draft_vocab))  # target id = i + 3
    return m.eval(), cfg


def _record(cfg: DrafterConfig, n: int, prompt_len: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(6, cfg.vocab_size, (n,), generator=g).int()
    feats = torch.randn(n - 1, cfg.num_features, cfg.hidden_size, generator=g).half()
    return {"tokens": toks, "prompt_len": prompt_len, "features": feats, "prompt_id": seed}


def test_multi_block_mask_equals_single_block_api():
    """Several blocks in one masked forward == each block drafted alone with only its context."""
    m, cfg = _tiny()
    recs = [_record(cfg, 20, 5, 1), _record(cfg, 14, 4, 2)]
    t2d = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
    t2d[3 : 3 + cfg.draft_vocab_size] = torch.arange(cfg.draft_vocab_size)
    batch = make_batch(recs, cfg, t2d, 3, random.Random(0), [0, 1])
    with torch.no_grad():
        logits = forward_batch(m, batch)
        for i, r in enumerate(recs):
            for b in range(3):
                a = int(batch.block_positions[i, b * cfg.block_size])
                ids, pos = make_block(r["tokens"][a : a + 1].long(), torch.tensor([a]), cfg.block_size, cfg.mask_token_id)
                feats = r["features"][:a].float()[None]
                out = m(ids, pos, context_features=feats, context_positions=torch.arange(a)[None])
                ref = logits[i, b * cfg.block_size : (b + 1) * cfg.block_size]
                torch.testing.assert_close(out.logits[0], ref, atol=1e-4, rtol=1e-4)


def test_kv_cache_append_and_crop():
    m, cfg = _tiny()
    r = _record(cfg, 16, 4, 3)
    feats = r["features"].float()[None]
    pos = torch.arange(15)[None]
    ids, bpos = make_block(torch.tensor([7]), torch.tensor([10]), cfg.block_size, cfg.mask_token_id)
    with torch.no_grad():
        full = m(ids, bpos, context_features=feats[:, :10], context_positions=pos[:, :10]).logits
        cache = DrafterKVCache()
        m(ids, bpos, context_features=feats[:, :6], context_positions=pos[:, :6], cache=cache)
        m(ids, bpos, context_features=feats[:, 6:13], context_positions=pos[:, 6:13], cache=cache)
        assert cache.length == 13
        cache.crop(10)  # drop 3 rejected tokens
        torch.testing.assert_close(m(ids, bpos, cache=cache).logits, full, atol=1e-5, rtol=1e-5)
        cache.append(m.context_kv(m.fuse_features(feats[:, 10:12]), pos[:, 10:12]))
        cache.crop(torch.arange(10))
        torch.testing.assert_close(m(ids, bpos, cache=cache).logits, full, atol=1e-5, rtol=1e-5)


def test_context_mask_ignores_padding():
    m, cfg = _tiny()
    r = _record(cfg, 12, 4, 4)
    feats = r["features"].float()[None]
    ids, bpos = make_block(torch.tensor([9]), torch.tensor([8]), cfg.block_size, cfg.mask_token_id)
    with torch.no_grad():
        ref = m(ids, bpos, context_features=feats[:, :8], context_positions=torch.arange(8)[None]).logits
        padded = torch.cat([feats[:, :8], torch.randn(1, 3, cfg.num_features, cfg.hidden_size)], 1)
        cmask = torch.tensor([[True] * 8 + [False] * 3])
        out = m(ids, bpos, context_features=padded, context_positions=torch.arange(11)[None], context_mask=cmask).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_save_load_roundtrip(tmp_path):
    m, cfg = _tiny()
    save_drafter(m, tmp_path, dtype=torch.float32)
    import json

    c = json.loads((tmp_path / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"]
    assert c["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [0, 1]}
    assert c["block_size"] == 4 and c["num_target_layers"] == 4 and c["draft_vocab_size"] == 40
    m2 = load_drafter(tmp_path, m.embed_tokens)
    for k, v in m.state_dict().items():
        torch.testing.assert_close(m2.state_dict()[k], v)
    torch.testing.assert_close(m2.mask_embedding, m.mask_embedding)
    # target logits: -inf outside the draft vocabulary, draft logits at d2t-mapped ids
    dl = torch.randn(2, cfg.draft_vocab_size)
    tl = m.to_target_logits(dl)
    assert torch.isinf(tl[:, :3]).all() and torch.equal(tl[:, 3 : 3 + cfg.draft_vocab_size], dl)


def test_build_draft_vocab_extends_an_existing_vocabulary():
    from collections import Counter

    from vllm_ddtree.train.dflash import build_draft_vocab

    recs = [{"tokens": torch.tensor([1, 2, 5, 5, 5, 7, 7, 9]), "prompt_len": 2}]
    small = build_draft_vocab(recs, 3)  # always (2,) + the two most frequent response tokens
    assert small.tolist() == [2, 5, 7]
    big = build_draft_vocab(recs, 6, always=tuple(small.tolist()), extra_counts=Counter({11: 3}))
    assert big.tolist() == [0, 2, 5, 7, 9, 11]  # old rows kept, 11 and 9 by score, then low-id fill

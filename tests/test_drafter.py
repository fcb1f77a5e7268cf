"""Fast checks of the DFlash drafter: block masking, KV cache, save/load round trip."""

from __future__ import annotations

import random

import pytest
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


def test_distillation_targets_line_up_with_the_labels():
    """make_batch(soft=True) reads the teacher row of each labelled slot's token (row r predicts
    token prompt_len + 1 + r, as extract --teacher-topk stores it): with the token itself as the
    teacher's only mass, distillation is plain CE; a second candidate outside the draft vocabulary is
    dropped and the rest renormalised; a spread distribution gives a different loss."""
    from vllm_ddtree.train.dflash import block_loss, slot_weights

    m, cfg = _tiny()
    t2d = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
    t2d[3 : 3 + cfg.draft_vocab_size] = torch.arange(cfg.draft_vocab_size)
    recs = []
    for seed, (n, pl) in enumerate([(20, 5), (14, 4)]):
        r = _record(cfg, n, pl, seed)
        nxt = r["tokens"][pl + 1 :].long()  # row r: token prompt_len + 1 + r
        outside = torch.full_like(nxt, 60)  # target id 60 has no draft row (draft ids cover 3..42)
        r["teacher_ids"] = torch.stack([nxt, outside], -1).int()
        r["teacher_logp"] = torch.tensor([-0.1, -2.4]).log_softmax(-1).expand(len(nxt), 2).half()
        recs.append(r)
    batch = make_batch(recs, cfg, t2d, 3, random.Random(0), [0, 1], soft=True)
    lab = batch.labels >= 0
    assert torch.equal(batch.soft_ids[..., 0][lab], batch.labels[lab])
    assert torch.allclose(batch.soft_p[..., 0][lab], torch.ones(int(lab.sum())))
    assert float(batch.soft_p[..., 1].abs().sum()) == 0.0 and float(batch.soft_p[~lab].abs().sum()) == 0.0
    w = slot_weights(cfg.block_size)
    with torch.no_grad():
        logits = forward_batch(m, batch)
    torch.testing.assert_close(block_loss(logits, batch, w, kd_weight=1.0), block_loss(logits, batch, w))
    batch.soft_p[..., 0] *= 0.5
    batch.soft_p[..., 1] = 0.5 * lab
    assert not torch.allclose(block_loss(logits, batch, w, kd_weight=1.0), block_loss(logits, batch, w))


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


def test_remap_draft_vocab_keeps_trained_rows_and_adds_embedding_rows():
    """Growing the draft vocabulary on resume: kept ids keep their (trained) rows and logits, new ids
    get the target's embedding row scaled like the kept rows, d2t maps every row to its target id."""
    from vllm_ddtree.train.dflash import remap_draft_vocab

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=64, draft_vocab_size=4,
                        block_size=4, target_layer_ids=[0, 1], num_target_layers=4, mask_token_id=5)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size)
    old_vocab, new_vocab = torch.tensor([2, 9, 30, 40]), torch.tensor([1, 2, 9, 17, 30, 40, 63])
    m = DFlashDrafter(cfg, emb)
    with torch.no_grad():
        m.lm_head.weight.copy_(2.0 * emb[old_vocab])  # "trained" rows: twice their embedding
        m.d2t.copy_(old_vocab - torch.arange(4))
    sd = remap_draft_vocab(m.state_dict(), old_vocab, new_vocab, emb)
    cfg2 = DrafterConfig(**{**cfg.__dict__, "draft_vocab_size": len(new_vocab)})
    m2 = DFlashDrafter(cfg2, emb)
    m2.load_state_dict(sd)
    assert torch.equal(m2.draft_to_target, new_vocab)
    w = m2.lm_head.weight.detach()
    torch.testing.assert_close(w[[1, 2, 4, 5]], m.lm_head.weight.detach())  # kept rows unchanged
    torch.testing.assert_close(w[[0, 3, 6]], 2.0 * emb[[1, 17, 63]])  # new rows: embedding × norm ratio
    r = _record(cfg, 12, 3, 5)
    ids, pos = make_block(r["tokens"][6:7].long(), torch.tensor([6]), cfg.block_size, cfg.mask_token_id)
    kw = dict(context_features=r["features"][:6].float()[None], context_positions=torch.arange(6)[None])
    with torch.no_grad():
        t1 = m.to_target_logits(m.eval()(ids, pos, **kw).logits)
        t2 = m2.to_target_logits(m2.eval()(ids, pos, **kw).logits)
    torch.testing.assert_close(t2[..., old_vocab], t1[..., old_vocab])  # same logits for kept ids
    assert torch.isfinite(t2[..., [1, 17, 63]]).all() and torch.isinf(t1[..., [1, 17, 63]]).all()


def test_shared_target_head_is_not_stored_and_reloads(tmp_path):
    """A drafter widened to the target's full vocabulary with the target's tied head: the checkpoint
    has no lm_head (vLLM then shares the target's), and it reloads with identical target logits."""
    from safetensors import safe_open

    from vllm_ddtree.train.dflash import widen_to_target_head

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=64, draft_vocab_size=4,
                        block_size=4, target_layer_ids=[0, 1], num_target_layers=4, mask_token_id=5)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size)
    vocab = torch.tensor([2, 9, 30, 40])
    m = DFlashDrafter(cfg, emb)
    with torch.no_grad():
        m.lm_head.weight.copy_(emb[vocab])  # frozen head = embedding rows (the default recipe)
        m.d2t.copy_(vocab - torch.arange(4))
    wide = widen_to_target_head(m).eval()
    assert wide.cfg.draft_vocab_size == cfg.vocab_size
    save_drafter(wide, tmp_path, dtype=torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "d2t" not in f.keys()
    back = load_drafter(tmp_path, emb).eval()
    r = _record(cfg, 12, 3, 5)
    ids, pos = make_block(r["tokens"][6:7].long(), torch.tensor([6]), cfg.block_size, cfg.mask_token_id)
    kw = dict(context_features=r["features"][:6].float()[None], context_positions=torch.arange(6)[None])
    with torch.no_grad():
        small = m.eval().to_target_logits(m(ids, pos, **kw).logits)
        out = back(ids, pos, **kw)
        full = back.to_target_logits(out.logits)
    torch.testing.assert_close(full[..., vocab], small[..., vocab])
    torch.testing.assert_close(out.logits, out.hidden @ emb.T)  # the target's tied head over all ids


def test_checkpoint_draft_vocab_narrows_the_shared_head_to_the_same_logits(tmp_path):
    """A shared-head checkpoint with draft_vocab.json loads with a head over those ids only:
    the same logits there, d2t mapping back to them; "full" ignores the file; bad files are refused."""
    import pytest

    from vllm_ddtree.drafter import DRAFT_VOCAB_FILE, load_draft_vocab, save_draft_vocab

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=64, draft_vocab_size=64,
                        block_size=4, target_layer_ids=[0, 1], num_target_layers=4, mask_token_id=5)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size)
    m = DFlashDrafter(cfg, emb)
    with torch.no_grad():
        m.lm_head.weight.copy_(emb)  # the target's tied head: not stored
    save_drafter(m, tmp_path, dtype=torch.float32)
    vocab = torch.tensor([2, 9, 30, 40, 63])
    save_draft_vocab(tmp_path, vocab[[3, 0, 4, 1, 2, 0]])  # any order, duplicates: stored sorted, unique
    assert torch.equal(load_draft_vocab(tmp_path, 64), vocab)
    narrow, full = load_drafter(tmp_path, emb).eval(), load_drafter(tmp_path, emb, draft_vocab="full").eval()
    assert narrow.cfg.draft_vocab_size == 5 and full.cfg.draft_vocab_size == 64
    assert torch.equal(narrow.draft_to_target, vocab)
    r = _record(cfg, 12, 3, 5)
    ids, pos = make_block(r["tokens"][6:7].long(), torch.tensor([6]), cfg.block_size, cfg.mask_token_id)
    kw = dict(context_features=r["features"][:6].float()[None], context_positions=torch.arange(6)[None])
    with torch.no_grad():
        a, b = narrow(ids, pos, **kw).logits, full(ids, pos, **kw).logits
    torch.testing.assert_close(a, b[..., vocab])
    with pytest.raises(ValueError, match="not in this drafter's vocabulary"):
        narrow.narrow_vocab(torch.tensor([2, 3]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 64\)"):
        save_draft_vocab(tmp_path, torch.tensor([1, 64]))
        load_draft_vocab(tmp_path, 64)
    (tmp_path / DRAFT_VOCAB_FILE).write_text('{"ids": [3, 1]}')
    with pytest.raises(ValueError, match="sorted"):
        load_drafter(tmp_path, emb)
    (tmp_path / DRAFT_VOCAB_FILE).write_text('{"ids": [1.5, 3]}')
    with pytest.raises(ValueError, match="integer target token ids"):
        load_drafter(tmp_path, emb)
    (tmp_path / DRAFT_VOCAB_FILE).write_text('[1, 3]')
    with pytest.raises(ValueError, match="a list 'ids'"):
        load_drafter(tmp_path, emb)
    with pytest.raises(ValueError, match="draft_vocab must be"):
        load_drafter(tmp_path, emb, draft_vocab="subset")


def test_training_log_plot_reads_resumed_runs_and_picked_up_shards(tmp_path):
    import json

    from vllm_ddtree.train.plot_log import plot_log, read_log

    recs = [
        {"event": "start", "step": 0, "train_seqs": 100, "train_resp_tokens": 20000, "cfg": {"num_hidden_layers": 1}},
        {"step": 10, "elapsed": 5.0, "loss": 9.0, "loss_ema": 9.0, "lr": 1e-4},
        {"event": "new_shard", "step": 100, "shard": "s.pt", "train_seqs": 150, "heldout_seqs": 5},
        {"step": 300, "eval": {"mean_accepted": 0.2, "loss": 4.5}},
        {"event": "start", "step": 300, "train_seqs": 150, "train_resp_tokens": 33000, "cfg": {"num_hidden_layers": 2}},
        {"step": 310, "elapsed": 9.0, "loss": 5.0, "loss_ema": 6.0, "lr": 1e-4},
        {"event": "final", "step": 310, "eval": {"mean_accepted": 0.25}},  # not a curve point
        # a fine-tune initialised from those weights counts from 0 again: drawn after step 310
        {"event": "start", "step": 0, "train_seqs": 80, "train_resp_tokens": 16000,
         "cfg": {"num_hidden_layers": 2}, "args": {"init_from": "checkpoints/x"}},
        {"step": 10, "elapsed": 1.0, "loss": 4.0, "loss_ema": 4.0, "lr": 1e-4},
        {"step": 20, "eval": {"mean_accepted": 0.3}},
    ]
    path = tmp_path / "train_log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    log = read_log(path)
    assert log["loss"] == [(10, 9.0), (310, 6.0), (320, 4.0)] and log["evals"] == [(300, 0.2), (330, 0.3)]
    assert log["data"] == [(0, 20000, True), (100, 30000.0, False), (300, 33000, True), (310, 16000, True)]
    assert log["eval_loss"] == [(300, 4.5)] and log["layers"] == [(0, 1), (300, 2), (310, 2)]
    plot_log(path, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_grow_layers_keeps_the_trained_drafter_and_its_adam_state():
    """Deepening a trained 1-layer drafter to 2 layers: same logits before any step (the new layer
    adds zero), the old parameters keep their Adam moments, and training then moves the new layer."""
    from vllm_ddtree.train.dflash import grow_layers

    small, cfg = _tiny()
    cfg1 = DrafterConfig(**{**cfg.__dict__, "num_hidden_layers": 1})
    torch.manual_seed(1)
    m1 = DFlashDrafter(cfg1, small.embed_tokens)
    for p in m1.parameters():
        torch.nn.init.normal_(p, std=0.3)
    r = _record(cfg, 12, 3, 5)
    ids, pos = make_block(r["tokens"][6:7].long(), torch.tensor([6]), cfg.block_size, cfg.mask_token_id)
    kw = dict(context_features=r["features"][:6].float()[None], context_positions=torch.arange(6)[None])

    def step(m, opt):
        opt.zero_grad()
        m(ids, pos, **kw).logits.logsumexp(-1).sum().backward()
        opt.step()

    opt1 = torch.optim.AdamW(list(m1.parameters()), lr=1e-2)
    step(m1, opt1)
    m2 = DFlashDrafter(cfg, small.embed_tokens)  # 2 layers, fresh (random) second layer
    params2 = list(m2.parameters())
    opt2 = torch.optim.AdamW(params2, lr=1e-2)
    sd, osd = grow_layers(m2, m1.state_dict(), opt1.state_dict(), params2)
    m2.load_state_dict(sd)
    opt2.load_state_dict(osd)
    with torch.no_grad():
        torch.testing.assert_close(m2(ids, pos, **kw).logits, m1(ids, pos, **kw).logits)
    assert not m2.layers[1].self_attn.o_proj.weight.any() and m2.layers[1].self_attn.q_proj.weight.any()
    moved = {n: opt2.state[p]["exp_avg"].clone() for n, p in m2.named_parameters() if p in opt2.state}
    assert set(moved) == {n for n, _ in m1.named_parameters()}  # exactly the trained parameters
    torch.testing.assert_close(moved["layers.0.mlp.up_proj.weight"], opt1.state[m1.layers[0].mlp.up_proj.weight]["exp_avg"])
    step(m2, opt2)
    assert m2.layers[1].self_attn.o_proj.weight.any()  # the new layer trains
    assert float(opt2.state[m2.layers[0].mlp.up_proj.weight]["step"]) == 2.0  # the old ones continue
    import pytest

    with pytest.raises(ValueError, match="only add layers"):
        grow_layers(m1, m2.state_dict(), opt2.state_dict(), list(m1.parameters()))


def test_drop_loops_counts_the_response_only_and_keeps_the_rest():
    from vllm_ddtree.train.dflash import drop_loops, max_ngram_repeats

    assert max_ngram_repeats(list(range(7))) == 0  # shorter than one 8-gram
    assert max_ngram_repeats(list(range(20))) == 1
    assert max_ngram_repeats([1, 2, 3] * 10, n=3) == 10
    loop = [5, 6, 7, 8] * 12  # "5 6 7 8" x 12: the 8-gram 5..8 5..8 occurs 11 times (overlapping)
    prose = list(range(100, 160))

    def rec(prompt: list[int], response: list[int]) -> dict:
        return {"tokens": torch.tensor(prompt + response), "prompt_len": len(prompt), "prompt_id": len(prompt)}

    records = [rec(prose[:10], loop), rec(loop, prose), rec(prose[:3], prose[10:] + loop[:40])]
    kept, dropped = drop_loops(records, max_repeats=5)
    # The first loops in its response (11 repeats); the second loops only in its prompt; the third
    # repeats the 8-gram 9 times (40 tokens of period 4: positions 0..32 step 4) and is dropped too.
    assert [r["prompt_len"] for r in kept] == [48] and dropped == 2
    kept, dropped = drop_loops(records, max_repeats=10)
    assert [r["prompt_len"] for r in kept] == [48, 3] and dropped == 1


def test_fine_tune_with_init_from_starts_from_the_checkpoint_and_keeps_its_data_record(tmp_path):
    """`train.dflash --init-from CKPT`, end to end on synthetic records with target-shaped features and a
    zero time budget: the exported drafter is CKPT's weights, the data manifest nests CKPT's own (the
    leak check of every stage stays on record) and the log's start names CKPT."""
    import json

    import pytest
    from conftest import TRAINED_DRAFTER
    from safetensors.torch import load_file

    from vllm_ddtree.train.dflash import is_heldout, main

    if not (TRAINED_DRAFTER / "data_manifest.json").exists():
        pytest.skip("no trained checkpoint committed")
    g = torch.Generator().manual_seed(0)
    held_ids = [i for i in range(200) if is_heldout({"prompt_id": i})][:2]
    train_ids = [i for i in range(200) if not is_heldout({"prompt_id": i})][:4]
    recs = [{"tokens": torch.randint(1000, 9000, (48,), generator=g, dtype=torch.int32), "prompt_len": 16,
             "features": torch.randn(47, 5, 576, generator=g), "mode": "greedy", "prompt_id": i}
            for i in held_ids + train_ids]
    data = tmp_path / "data"
    data.mkdir()
    torch.save(recs, data / "shard_00000.pt")
    (data / "meta.json").write_text(json.dumps({"feature_layer_ids": [1, 8, 14, 20, 27], "eos_id": 2}))
    out = tmp_path / "run"
    threads = str(torch.get_num_threads())  # main() sets torch's thread count for the rest of this process
    main(["--data", str(data), "--out", str(out), "--minutes", "0", "--layers", "2", "--threads", threads,
          "--vocab-file", str(TRAINED_DRAFTER), "--init-from", str(TRAINED_DRAFTER),
          "--export-shared-head", str(tmp_path / "export")])

    manifest = json.loads((tmp_path / "export" / "data_manifest.json").read_text())
    assert manifest["train_sequences"] == 4 and manifest["heldout_sequences"] == 2
    assert manifest["init_from"] == json.loads((TRAINED_DRAFTER / "data_manifest.json").read_text())
    start = json.loads((out / "train_log.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["args"]["init_from"] == str(TRAINED_DRAFTER)
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    committed = load_file(str(TRAINED_DRAFTER / "model.safetensors"))
    assert exported.keys() == committed.keys()
    assert all(torch.equal(exported[k], committed[k]) for k in committed)


def test_bf16_autocast_step_keeps_float32_state_and_the_float32_gradient():
    """``train.dflash --bf16``: the forward runs in bfloat16 (logits come out bf16), the parameters and
    their gradients stay float32, the loss is finite, and the gradient points where float32's does."""
    from vllm_ddtree.train.dflash import block_loss, slot_weights

    m, cfg = _tiny()
    m.train()
    recs = [_record(cfg, 40, 6, 11), _record(cfg, 25, 4, 12)]  # unequal lengths: padded context columns
    t2d = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
    t2d[3 : 3 + cfg.draft_vocab_size] = torch.arange(cfg.draft_vocab_size)
    batch = make_batch(recs, cfg, t2d, 6, random.Random(0), [0, 1])
    w = slot_weights(cfg.block_size)

    def grads(bf16: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = forward_batch(m, batch)
        loss = block_loss(logits, batch, w)
        loss.backward()
        g = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        return logits, g, float(loss.detach())

    logits32, g32, loss32 = grads(False)
    logits16, g16, loss16 = grads(True)
    assert logits32.dtype == torch.float32 and logits16.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32) for p in m.parameters())
    assert torch.isfinite(g16).all() and abs(loss16 - loss32) < 0.05 * abs(loss32)
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.99


def test_add_shard_filters_each_shard_and_sums_the_manifest(tmp_path):
    """Training data loads shard by shard: each shard is leak-filtered, split by prompt id, and its
    looping training records dropped before the next loads; held-out records keep their loops (the
    held-out set measures the real distribution) and the manifest sums over shards."""
    from transformers import AutoTokenizer

    from vllm_ddtree.data.humaneval import load_humaneval
    from vllm_ddtree.models.target import prepare_target
    from vllm_ddtree.train.dflash import add_shard, empty_training_data, is_heldout

    tdir = prepare_target()
    tok = AutoTokenizer.from_pretrained(tdir)
    held_ids = [i for i in range(300) if is_heldout({"prompt_id": i})][:2]
    train_ids = [i for i in range(300) if not is_heldout({"prompt_id": i})][:6]
    prose = list(range(100, 160))
    loop = [5, 6, 7, 8] * 12
    leaked = tok(load_humaneval(3)[2]["prompt"], add_special_tokens=False)["input_ids"]

    def rec(pid: int, response: list[int], mode: str = "greedy") -> dict:
        return {"tokens": torch.tensor(prose[:10] + response), "prompt_len": 10, "prompt_id": pid, "mode": mode}

    shard_a = [rec(train_ids[0], prose), rec(train_ids[1], loop), rec(held_ids[0], loop)]
    shard_b = [rec(train_ids[2], prose, "sample"), rec(train_ids[3], leaked), rec(held_ids[1], prose),
               rec(train_ids[4], loop)]
    for name, recs in (("shard_a.pt", shard_a), ("shard_b.pt", shard_b)):
        torch.save(recs, tmp_path / name)
    data = empty_training_data(drop_loops_repeats=5)
    add_shard(data, tmp_path / "shard_a.pt", tdir, 5)
    assert [r["prompt_id"] for r in data.train] == [train_ids[0]]
    assert [r["prompt_id"] for r in data.held] == [held_ids[0]]  # loops, but held out: kept
    add_shard(data, tmp_path / "shard_b.pt", tdir, 5)
    assert [r["prompt_id"] for r in data.train] == [train_ids[0], train_ids[2]]
    assert [r["prompt_id"] for r in data.held] == held_ids
    m = data.manifest
    assert m["sequences_generated"] == 7 and m["modes"] == {"greedy": 5, "sample": 1}
    assert m["leak_check"]["dropped"] == 1 and m["leak_check"]["dropped_tasks"] == ["HumanEval/2"]
    assert m["leak_check"]["texts_checked"] == m["train_sequences"] == 2 and m["heldout_sequences"] == 2
    assert m["loop_filter"] == {"ngram": 8, "max_repeats": 5, "dropped": 2}
    assert m["train_response_tokens"] == 2 * len(prose) and m["train_tokens_total"] == 2 * (10 + len(prose))


def test_committed_drafter_directory_is_within_25_mb():
    """The toy drafter stays within 25 MB on disk (it ships with the repository). The whole committed directory counts (weights,
    vocabulary, mask vector, log, plot, README): a third layer's weights alone come to 24.6 MB, so
    growing the drafter would also mean trimming what ships beside it."""
    from conftest import TRAINED_DRAFTER

    if not (TRAINED_DRAFTER / "model.safetensors").exists():
        pytest.skip("no trained checkpoint committed yet")
    total = sum(f.stat().st_size for f in TRAINED_DRAFTER.rglob("*") if f.is_file())
    assert total <= 25_000_000, f"{TRAINED_DRAFTER} holds {total / 1e6:.2f} MB"

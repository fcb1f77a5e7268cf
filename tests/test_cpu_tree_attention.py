"""The CPU tree attention backend, checked against a dense SDPA reference on a real paged layout.

Builds vLLM's own CommonAttentionMetadata for a mixed batch (a prefill chunk, a decode row, a
tree verify with an off-spine tree) over shuffled physical blocks, runs the backend's cache update
and forward, and compares with attention computed directly on the unpaged K/V. Every cache layout:
vLLM CPU_ATTN's (written by its own kernel; its AMX ISA's bfloat16 layout where the CPU has AMX) and
the backend's fallback.
"""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from vllm_ddtree.attention.cpu_tree import TreeAttentionImpl, TreeAttentionMetadataBuilder  # noqa: E402
from vllm_ddtree.attention.tree_mask import TreeStepMasks, set_step_tree_masks  # noqa: E402
from vllm_ddtree.tree import build_tree, compile_tree, dense_attention_mask, topk_per_depth  # noqa: E402

HEADS, KV_HEADS, HD, BS = 4, 2, 16, 8
#: The dtype each layout is tested in: CPU_ATTN's AMX ISA serves bfloat16 only.
DTYPES = {"cpu_attn": torch.float32, "rows": torch.float32, "cpu_attn_amx": torch.bfloat16}


def has_amx_attention() -> bool:
    """Whether vLLM's CPU_ATTN picks its AMX ISA here (bfloat16, a CPU with AMX tiles)."""
    from vllm_ddtree.attention import cpu_tree

    return cpu_tree.cache_isa(torch.bfloat16, 32, 64) == "amx"


def force_layout(layout: str, block_size: int, head_dim: int, monkeypatch) -> None:
    """Make the backend use `layout`; a CPU_ATTN layout must be what the probe finds for these sizes."""
    from vllm_ddtree.attention import cpu_tree

    if layout == "cpu_attn_amx" and not has_amx_attention():
        pytest.skip("CPU_ATTN's AMX ISA needs a CPU with AMX tiles")
    if layout != "rows":
        dtype = DTYPES[layout]
        isa = cpu_tree.cache_isa(dtype, block_size, head_dim)
        assert cpu_tree.kv_layout(dtype, block_size, head_dim, isa) == layout
    else:
        monkeypatch.setattr(cpu_tree, "kv_layout", lambda *args: "rows")


def vllm_cpu_attention(block_size: int, head_dim: int, monkeypatch, dtype: torch.dtype = torch.float32):
    """vLLM's own CPU_ATTN builder and impl for these sizes, outside an engine: the builder without its
    constructor (which reads the engine's layers), the impl with the model dtype it reads from the
    current vLLM config given directly. Their build() and forward() are vLLM's, unchanged."""
    from vllm.v1.attention.backends import cpu_attn

    from vllm_ddtree.attention import cpu_tree

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=dtype)))
    impl = cpu_attn.CPUAttentionBackendImpl(HEADS, head_dim, head_dim**-0.5, KV_HEADS, None, None, "auto")
    builder = object.__new__(cpu_attn.CPUAttentionMetadataBuilder)
    builder.__dict__.update(num_kv_heads=KV_HEADS, num_heads=HEADS, head_dim=head_dim, dtype=dtype,
                            window_size=-1, block_size=block_size, kv_cache_dtype="auto",
                            isa=cpu_tree.cache_isa(dtype, block_size, head_dim),
                            is_cross_attention=False, is_encoder_only_attention=False)
    return builder, impl


def spec(block_size: int = BS, head_dim: int = HD, dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    return SimpleNamespace(block_size=block_size, num_kv_heads=KV_HEADS, dtype=dtype, head_size=head_dim)


def make_tree(num_nodes, ctx):
    lp, ids = topk_per_depth(torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(1)) * 2, 6)
    return compile_tree(build_tree(lp, ids, num_nodes), torch.tensor([1]), torch.tensor([ctx]))


def paged_batch(ctx: list[int], qlen: list[int], bs: int, hd: int, g: torch.Generator, spare: int,
                dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    """Requests with `ctx` cached and `qlen` new tokens over shuffled physical blocks (`spare` unused):
    their full K/V and this step's queries at random in `dtype`, and the slot of (request, position)."""
    seq = [c + q for c, q in zip(ctx, qlen)]
    r = len(seq)
    max_blocks = (max(seq) + bs - 1) // bs
    num_blocks = r * max_blocks + spare
    perm = torch.randperm(num_blocks, generator=g)[: r * max_blocks].view(r, max_blocks)
    return SimpleNamespace(
        seq=seq, total=sum(qlen), perm=perm, kv_cache=torch.zeros(num_blocks, KV_HEADS, bs, 2 * hd, dtype=dtype),
        keys=[torch.randn(s, KV_HEADS, hd, generator=g).to(dtype) for s in seq],
        vals=[torch.randn(s, KV_HEADS, hd, generator=g).to(dtype) for s in seq],
        query=torch.randn(sum(qlen), HEADS, hd, generator=g).to(dtype),
        qsl=torch.tensor([0, *torch.cumsum(torch.tensor(qlen), 0).tolist()]),
        slots=lambda rr, pos: perm[rr, pos // bs] * bs + pos % bs)


def tree_backend(bs: int, hd: int, dtype: torch.dtype = torch.float32
                 ) -> tuple[TreeAttentionImpl, TreeAttentionMetadataBuilder, SimpleNamespace]:
    """The backend's impl and builder (no vLLM config: no CPU_ATTN at hand) and the layer vLLM's impl reads."""
    impl = TreeAttentionImpl(HEADS, hd, hd**-0.5, KV_HEADS, None, None, "auto")
    builder = TreeAttentionMetadataBuilder(spec(bs, hd, dtype), ["model.layers.0.attn"], None, "cpu")
    return impl, builder, SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)


@pytest.mark.parametrize("layout, BS, HD, kernel", [("cpu_attn", 16, 32, True), ("cpu_attn", 16, 32, False),
                                                    ("rows", BS, HD, False), ("cpu_attn_amx", 32, 64, True),
                                                    ("cpu_attn_amx", 32, 64, False)])
@pytest.mark.parametrize("separate", [128, 4, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_backend_matches_dense_attention(causal, separate, layout, BS, HD, kernel, monkeypatch):
    """`separate`: requests with more queries are attended on their own (128: none here, one padded
    batch; 4: the 5-query chunk and the 10-row tree apart, the decode row alone; 1: all apart).
    `kernel`: with vLLM's CPU_ATTN builder and impl at hand, as in an engine: a causal step's
    requests without a tree go to CPU_ATTN's kernel, the tree to SDPA. bfloat16 ("cpu_attn_amx") is
    compared with float32 attention over the same bfloat16 values, to bfloat16's precision."""
    from vllm_ddtree.attention import cpu_tree

    monkeypatch.setattr(cpu_tree, "SEPARATE_QUERY_LEN", separate)
    force_layout(layout, BS, HD, monkeypatch)
    g = torch.Generator().manual_seed(0)
    # request 0: prefill chunk of 5 after 7 cached; request 1: one decode row after 20;
    # request 2: tree verify of 1 + 9 rows after 11 cached tokens.
    tree = make_tree(9, 11)
    ctx = [7, 20, 11]
    qlen = [5, 1, int(tree.num_rows[0])]
    dtype = DTYPES[layout]
    b = paged_batch(ctx, qlen, BS, HD, g, spare=3, dtype=dtype)
    seq, total, perm, kv_cache, keys, vals, query, qsl, slots = (b.seq, b.total, b.perm, b.kv_cache, b.keys, b.vals,
                                                                 b.query, b.qsl, b.slots)
    r = 3
    impl, builder, layer = tree_backend(BS, HD, dtype)
    if kernel:
        builder.stock, impl.stock = vllm_cpu_attention(BS, HD, monkeypatch, dtype)
    # the cached context first, then this step's tokens (what vLLM does before forward)
    for rr in range(r):
        pos = torch.arange(ctx[rr])
        impl.do_kv_cache_update(layer, keys[rr][: ctx[rr]], vals[rr][: ctx[rr]], kv_cache, slots(rr, pos))
    new_slots = torch.cat([slots(rr, torch.arange(ctx[rr], seq[rr])) for rr in range(r)])
    new_k = torch.cat([keys[rr][ctx[rr] :] for rr in range(r)])
    new_v = torch.cat([vals[rr][ctx[rr] :] for rr in range(r)])
    pad = torch.zeros(1, KV_HEADS, HD, dtype=dtype)  # a padded token with slot -1 must not be written
    impl.do_kv_cache_update(layer, torch.cat([new_k, pad]), torch.cat([new_v, pad]), kv_cache, torch.cat([new_slots, torch.tensor([-1])]))

    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq), num_reqs=r,
        num_actual_tokens=total, max_query_len=max(qlen), max_seq_len=max(seq),
        block_table_tensor=perm.int(), slot_mapping=new_slots, causal=causal,
    )
    n = tree.max_rows
    masks = TreeStepMasks(
        has_tree=torch.tensor([False, False, True]), num_rows=torch.tensor([0, 0, qlen[2]]),
        ancestors=torch.cat([torch.zeros(2, n, n, dtype=torch.bool), tree.ancestors]),
    )
    assert builder.layout == layout
    set_step_tree_masks(masks)
    try:
        md = builder.build(0, cm)
    finally:
        set_step_tree_masks(None)
    if kernel and causal:  # the chunk and the decode row by the kernel, the tree alone by SDPA
        assert len(md.parts) == 1 and md.kernel_part[1].tolist() == list(range(qlen[0] + qlen[1]))
    else:
        assert md.kernel_part is None and len(md.parts) == {128: 0, 4: 3, 1: 3}[separate]
    out = torch.zeros(total, HEADS * HD, dtype=dtype)
    impl.forward(layer, query, new_k, new_v, kv_cache, md, out)

    tree_mask = dense_attention_mask(tree, seq[2])[0, : qlen[2]]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for rr in range(r):
        q = query[qsl[rr] : qsl[rr + 1]].float().transpose(0, 1)  # [H, q, hd]
        k = keys[rr].float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        v = vals[rr].float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        if rr == 2:
            m = tree_mask
        elif causal:
            m = torch.arange(seq[rr])[None, :] <= ctx[rr] + torch.arange(qlen[rr])[:, None]
        else:
            m = torch.ones(qlen[rr], seq[rr], dtype=torch.bool)
        ref = torch.softmax((q @ k.transpose(1, 2)) * HD**-0.5 + torch.where(m, 0.0, -torch.inf), -1) @ v
        got = out[qsl[rr] : qsl[rr + 1]].view(-1, HEADS, HD).transpose(0, 1).float()
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_tree_masks_are_not_applied_to_other_layers():
    builder = TreeAttentionMetadataBuilder(spec(), ["draft_model.layers.0.attn"], None, "cpu")
    qsl = torch.tensor([0, 3])
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([5]), num_reqs=1, num_actual_tokens=3,
        max_query_len=3, max_seq_len=5, block_table_tensor=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.arange(2, 5), causal=True,
    )
    set_step_tree_masks(TreeStepMasks(torch.tensor([True]), torch.tensor([3]), torch.zeros(1, 3, 3, dtype=torch.bool),
                                      layer_prefix="model."))
    try:
        md = builder.build(0, cm)
    finally:
        set_step_tree_masks(None)
    causal = torch.arange(md.max_seq_len)[None, :] <= 2 + torch.arange(3)[:, None]
    assert torch.equal(md.mask[0, 0], causal)


def test_unsupported_features_fail_clearly():
    with pytest.raises(NotImplementedError, match="sliding window"):
        TreeAttentionImpl(HEADS, HD, 1.0, KV_HEADS, None, 128, "auto")


def test_cache_update_follows_a_reused_slot_buffer(monkeypatch):
    """The update's rows ("rows" layout) are computed once per step and shared by the layers; a runner
    that rewrites the same slot buffer in place for the next step must still get its new slots written."""
    force_layout("rows", BS, HD, monkeypatch)
    impl = TreeAttentionImpl(HEADS, HD, HD**-0.5, KV_HEADS, None, None, "auto")
    g = torch.Generator().manual_seed(3)
    caches = [torch.zeros(4, KV_HEADS, BS, 2 * HD) for _ in range(2)]
    slots = torch.tensor([3, 9, -1])  # one buffer, two steps
    for step_slots in ([3, 9, -1], [17, 4, 30]):
        slots.copy_(torch.tensor(step_slots))
        k, v = torch.randn(3, KV_HEADS, HD, generator=g), torch.randn(3, KV_HEADS, HD, generator=g)
        for cache in caches:  # two layers, same slot tensor
            impl.do_kv_cache_update(None, k, v, cache, slots)
            kv = cache.view(4, KV_HEADS, 2, BS, HD)
            for t, s in enumerate(step_slots):
                if s >= 0:
                    assert torch.equal(kv[s // BS, :, 0, s % BS], k[t]) and torch.equal(kv[s // BS, :, 1, s % BS], v[t])
    written = (caches[0].view(4, KV_HEADS, 2, BS, HD).abs().sum((1, 2, 4)) > 0).nonzero().tolist()
    assert written == [[0, 3], [0, 4], [1, 1], [2, 1], [3, 6]]  # slots 3, 4, 9, 17, 30; nothing for -1


def test_layout_probe_reads_back_the_kernels_writes(monkeypatch):
    """CPU_ATTN's layout is used only where what its kernel writes reads back through our views."""
    from vllm_ddtree.attention import cpu_tree

    isa = cpu_tree.cache_isa(torch.float32, 32, 64)
    assert cpu_tree.kv_layout.__wrapped__(torch.float32, 32, 64, isa) == "cpu_attn"
    if has_amx_attention():  # bfloat16's tiles, at vLLM's CPU block sizes and common head sizes
        for bs, hd in [(32, 64), (128, 64), (128, 128), (64, 96)]:
            assert cpu_tree.kv_layout.__wrapped__(torch.bfloat16, bs, hd, "amx") == "cpu_attn_amx", (bs, hd)

    def token_major(key, value, key_cache, value_cache, slots, isa, **kwargs):  # K not transposed
        b, o = slots // key_cache.shape[2], slots % key_cache.shape[2]
        key_cache[b, :, o] = key
        value_cache[b, :, o] = value

    monkeypatch.setattr(cpu_tree.ops, "cpu_attn_reshape_and_cache", token_major)
    assert cpu_tree.kv_layout.__wrapped__(torch.float32, 32, 64, isa) == "rows"


def chain_tree(depth, ctx):
    """A tree of `depth` nodes that is one path (each depth's first candidate far ahead of the rest)."""
    logits = torch.randn(1, depth, 6, generator=torch.Generator().manual_seed(2))
    logits[:, :, 0] += 30
    lp, ids = topk_per_depth(logits, 6)
    return compile_tree(build_tree(lp, ids, depth), torch.tensor([1]), torch.tensor([ctx]))


@pytest.mark.parametrize("as_chain", ["detected", "every tree (wrong)"])
def test_one_path_trees_take_the_kernel_branching_trees_sdpa(as_chain, monkeypatch):
    """A decode row, a tree that is one path (its mask is causal) and a branching tree in one verify
    step: the first two go to CPU_ATTN's kernel, the branching tree to SDPA, all equal to dense
    attention. Negative control: routing the branching tree to the causal kernel too must fail."""
    from vllm_ddtree.attention import cpu_tree
    from vllm_ddtree.attention.tree_mask import chain_trees

    bs, hd = 16, 32
    force_layout("cpu_attn", bs, hd, monkeypatch)
    if as_chain != "detected":
        monkeypatch.setattr(cpu_tree, "chain_trees", lambda tree: tree.has_tree.clone())
    g = torch.Generator().manual_seed(3)
    chain, branching = chain_tree(4, 13), make_tree(9, 11)
    assert chain_trees(TreeStepMasks(torch.tensor([True]), chain.num_rows, chain.ancestors)).tolist() == [True]
    assert chain_trees(TreeStepMasks(torch.tensor([True]), branching.num_rows, branching.ancestors)).tolist() == [False]
    ctx = [20, 13, 11]
    qlen = [1, int(chain.num_rows[0]), int(branching.num_rows[0])]
    b = paged_batch(ctx, qlen, bs, hd, g, spare=2)
    seq, total, perm, kv_cache, keys, vals, query, qsl, slots = (b.seq, b.total, b.perm, b.kv_cache, b.keys, b.vals,
                                                                 b.query, b.qsl, b.slots)
    r = 3
    impl, builder, layer = tree_backend(bs, hd)
    builder.stock, impl.stock = vllm_cpu_attention(bs, hd, monkeypatch)
    all_slots = torch.cat([slots(rr, torch.arange(seq[rr])) for rr in range(r)])
    impl.do_kv_cache_update(layer, torch.cat(keys), torch.cat(vals), kv_cache, all_slots)
    new_slots = torch.cat([slots(rr, torch.arange(ctx[rr], seq[rr])) for rr in range(r)])
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.int(), query_start_loc_cpu=qsl.int(), seq_lens=torch.tensor(seq).int(), num_reqs=r,
        num_actual_tokens=total, max_query_len=max(qlen), max_seq_len=max(seq),
        block_table_tensor=perm.int(), slot_mapping=new_slots, causal=True,  # vLLM's index types
    )
    n = max(chain.max_rows, branching.max_rows)
    pad = lambda a: torch.nn.functional.pad(a, (0, n - a.shape[2], 0, n - a.shape[1]))  # noqa: E731
    masks = TreeStepMasks(has_tree=torch.tensor([False, True, True]), num_rows=torch.tensor([0, qlen[1], qlen[2]]),
                          ancestors=torch.cat([torch.zeros(1, n, n, dtype=torch.bool), pad(chain.ancestors),
                                               pad(branching.ancestors)]))
    set_step_tree_masks(masks)
    try:
        md = builder.build(0, cm)
    finally:
        set_step_tree_masks(None)
    if as_chain == "detected":
        assert len(md.parts) == 1 and md.kernel_part[1].tolist() == list(range(qlen[0] + qlen[1]))
    else:  # nothing left for SDPA: the whole step is vLLM's
        assert not isinstance(md, cpu_tree.TreeAttentionMetadata)
    out = torch.zeros(total, HEADS * hd)
    impl.forward(layer, query, None, None, kv_cache, md, out)
    masks_ref = [torch.arange(seq[0])[None, :] <= ctx[0],
                 dense_attention_mask(chain, seq[1])[0, : qlen[1]],
                 dense_attention_mask(branching, seq[2])[0, : qlen[2]]]
    errors = []
    for rr in range(r):
        q = query[qsl[rr] : qsl[rr + 1]].transpose(0, 1)
        k = keys[rr].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        v = vals[rr].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        ref = torch.softmax((q @ k.transpose(1, 2)) * hd**-0.5 + torch.where(masks_ref[rr], 0.0, -torch.inf), -1) @ v
        got = out[qsl[rr] : qsl[rr + 1]].view(-1, HEADS, hd).transpose(0, 1)
        errors.append(float((got - ref).abs().max()))
    if as_chain == "detected":
        assert max(errors) < 1e-5, errors
    else:  # the branching tree attended causally: its rows see siblings' K/V
        assert errors[0] < 1e-5 and errors[1] < 1e-5 and errors[2] > 1e-2, errors


@pytest.mark.parametrize("layout, bs, hd, dtype", [("cpu_attn", 8, 16, torch.float32),
                                                   ("cpu_attn_amx", 32, 64, torch.float32),
                                                   ("cpu_attn_amx", 32, 64, torch.bfloat16),
                                                   ("cpu_attn_amx", 16, 48, torch.bfloat16)])
def test_block_unpacking_matches_the_layouts_element_indices(layout, bs, hd, dtype):
    """What the SDPA path reads from whole blocks (`unpack_blocks`, a permute) is what compaction moves
    and the probe reads (`cpu_attn_elements`, index arithmetic): two spellings of one layout, on any CPU."""
    from vllm_ddtree.attention.cpu_tree import unpack_blocks
    from vllm_ddtree.compaction import cpu_attn_elements

    nb, r, n = 5, 2, 2
    cache = torch.randn(nb, KV_HEADS, bs, 2 * hd, generator=torch.Generator().manual_seed(4)).to(dtype)
    table = torch.tensor([[3, 0], [4, 1]])  # request r's blocks, in order
    blocks = cache.view(nb, KV_HEADS, 2, bs * hd)[table.flatten()].view(r, n, KV_HEADS, 2, bs * hd)
    k, v = unpack_blocks(blocks, layout, bs, hd)  # [R, kv_heads, n * bs, hd]
    pos = torch.arange(n * bs)
    elements = cpu_attn_elements(table[:, pos // bs], (pos % bs).expand(r, -1), KV_HEADS, bs, hd, layout)
    read = cache.flatten()[elements]  # [R, n * bs, kv_heads, 2, hd]
    assert torch.equal(k, read[:, :, :, 0].transpose(1, 2)) and torch.equal(v, read[:, :, :, 1].transpose(1, 2))
    other = "cpu_attn" if layout == "cpu_attn_amx" else "cpu_attn_amx"  # negative control: the other layout
    if bs % 16 == 0 and hd % 16 == 0:
        assert not torch.equal(unpack_blocks(blocks, other, bs, hd)[0], k)

"""vLLM's CPU attention for a ddtree engine: CPU_ATTN's kernel where no tree is verified, SDPA with
per-request tree masks where one is.

Why: vLLM 0.32's CPU_ATTN kernel takes no mask (only causal / per-request causal) and returns no
log-sum-exp (docs/design.md §10.2), so a draft tree cannot be verified with it. This backend is
registered over CPU_ATTN for ddtree engines (the CPU platform always resolves CPU_ATTN) and serves
every attention on the CPU: the target's prefill and decode rows (causal), the DFlash drafter's block
(non-causal, its context K/V written through `do_kv_cache_update`), and the target's verify rows of
a draft tree.

Two paths, one cache. A step whose layers have no tree masks (prefill, plain decode, a step in which
no request drafted, every drafter step) is vLLM's own: `CPUAttentionMetadataBuilder.build` and
`CPUAttentionBackendImpl.forward`, unchanged, on a cache CPU_ATTN wrote itself. In a verify step,
the requests whose tree branches are attended with PyTorch SDPA and the tree mask, reading the same
cache back; the step's other requests (no tree, or a tree that is one path, whose mask is causal:
`tree_mask.chain_trees`) go to the kernel as a batch of their own.

Cache layouts (a layer's cache is [num_blocks, kv_heads, block_size, 2 * head_dim], LBHNC; per
(block, KV head) the storage is 2 * block_size * head_dim values, K then V):
- "cpu_attn": CPU_ATTN's own with its vec/vec16 ISAs, written by its `cpu_attn_reshape_and_cache`:
  K as [head_dim, block_size] (transposed), V as [block_size, head_dim].
- "cpu_attn_amx": CPU_ATTN's own with its AMX ISA (bfloat16 on CPUs with AMX tiles): K and V packed
  as the tiles load them, pairs of bf16 values in rows of 16 (`compaction.cpu_attn_elements`).
- "rows": ours, where the probe reads back neither: K rows then V rows, both token-major, every step
  through SDPA.
The kernel does not document its storage, so it is probed (:func:`kv_layout`): written by the kernel
and read back, once per dtype, block size, head size and ISA; a CPU_ATTN layout is used only where
the probe reads back what was written.

Per verify step the builder does everything that is the same for all layers once: which cache
blocks (CPU_ATTN's layouts) or rows ("rows", :func:`cache_rows`) hold each request's K and V, the padded
query index, and the boolean mask [R, max_q, max_kv]. Each layer's forward is then one gather of K
and V together, one SDPA with the query heads of a KV head folded into its query rows (no K/V
repeat for GQA), and one row scatter of the output.

Tree masks: the model runner hands them over through `tree_mask.set_step_tree_masks` before it
builds attention metadata for a verify step; the builder of the layers named by
`TreeStepMasks.layer_prefix` consumes them. Which position each query may see is decided in
:mod:`vllm_ddtree.attention.tree_mask` (shared with the GPU kernels' metadata).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm import _custom_ops as ops
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionImpl, AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
    _get_attn_isa,
)

from vllm_ddtree.attention.tree_mask import TreeStepMasks, build_attention_mask, chain_trees, step_tree_masks_for
from vllm_ddtree.compaction import cache_rows, cpu_attn_elements

__all__ = ["TreeAttentionBackend", "TreeStepMasks", "build_attention_mask", "cache_layout", "kv_layout", "register"]

# Under the "vllm" namespace so vLLM's log configuration (format, level) applies to our lines.
logger = init_logger("vllm.ddtree.attention")

KV_LAYOUT_CPU_ATTN = "cpu_attn"  # CPU_ATTN's: per (block, KV head) K as [head_dim, block_size], then V token-major
KV_LAYOUT_CPU_ATTN_AMX = "cpu_attn_amx"  # CPU_ATTN's AMX ISA: per (block, KV head) K, then V, packed for its tiles
KV_LAYOUT_ROWS = "rows"  # ours: per (block, KV head) K rows, then V rows, token-major
#: The layouts CPU_ATTN's kernel reads and writes, in the order the probe tries them.
KERNEL_LAYOUTS = (KV_LAYOUT_CPU_ATTN, KV_LAYOUT_CPU_ATTN_AMX)

#: Steps without tree masks run CPU_ATTN's kernel where the cache is in its layout. False sends every
#: step through SDPA (a check of that path on plain steps; it is what the "rows" layout always does).
STOCK_KERNEL_FOR_PLAIN_STEPS = True


def unpack_blocks(blocks: Tensor, layout: str, block_size: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Whole cache blocks gathered per request, [R, n, kv_heads, 2, block_size * head_dim] in a CPU_ATTN
    layout, as SDPA's K and V [R, kv_heads, n * block_size, head_dim] (a permute and one copy each)."""
    r, n, kvh = blocks.shape[:3]
    k, v = blocks[:, :, :, 0], blocks[:, :, :, 1]
    if layout == KV_LAYOUT_CPU_ATTN_AMX:  # K [t // 16, d // 2, t % 16, d % 2], V [d // 16, t // 2, d % 16, t % 2]
        if k.element_size() == 2:  # bfloat16: K's (d, d + 1) pairs are adjacent, so each moves as one 4-byte value
            k = k.view(torch.int32).unflatten(-1, (block_size // 16, head_dim // 2, 16)).permute(0, 2, 1, 3, 5, 4)
            k = k.reshape(r, kvh, n * block_size, head_dim // 2).view(blocks.dtype)
        else:
            k = k.unflatten(-1, (block_size // 16, head_dim // 2, 16, 2)).permute(0, 2, 1, 3, 5, 4, 6)
        v = v.unflatten(-1, (head_dim // 16, block_size // 2, 16, 2)).permute(0, 2, 1, 4, 6, 3, 5)
    else:  # K [d, t] (transposed), V [t, d]
        k = k.unflatten(-1, (head_dim, block_size)).permute(0, 2, 1, 4, 3)
        v = v.unflatten(-1, (block_size, head_dim)).permute(0, 2, 1, 3, 4)
    return k.reshape(r, kvh, n * block_size, head_dim), v.reshape(r, kvh, n * block_size, head_dim)


def write_cpu_attn_kv(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor, isa: str,
                      kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """CPU_ATTN's cache write (`CPUAttentionBackendImpl.do_kv_cache_update`, which needs a layer for
    its ISA and scales): key/value [n, kv_heads, head_dim] at `slot_mapping` [n] (-1: not written)."""
    nb, kvh, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, kvh, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa,
                                   k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)


@functools.lru_cache(maxsize=None)
def kv_layout(dtype: torch.dtype, block_size: int, head_size: int, isa: str) -> str:
    """The layout the caches of this dtype, block size, head size and CPU_ATTN ISA get: the first of
    `KERNEL_LAYOUTS` through which what CPU_ATTN's kernel writes reads back, else "rows".

    Probed, not assumed: the kernel's storage depends on the ISA and is not part of vLLM's API. A
    probe writes distinct values into every slot of a small cache in a shuffled order and compares
    what each layout's element indices (`compaction.cpu_attn_elements`) read with what was written.
    """
    g = torch.Generator().manual_seed(0)
    nb, kvh = 3, 2
    n = nb * block_size
    key = torch.randn(n, kvh, head_size, generator=g).to(dtype)
    value = torch.randn(n, kvh, head_size, generator=g).to(dtype)
    slots = torch.randperm(n, generator=g)
    cache = torch.zeros(nb, kvh, block_size, 2 * head_size, dtype=dtype)
    try:
        write_cpu_attn_kv(key, value, cache, slots, isa)
    except (RuntimeError, NotImplementedError) as e:  # an ISA this build of vLLM lacks
        logger.warning("vllm-ddtree: CPU_ATTN's cache write failed for ISA %s (%s); KV kept in vllm-ddtree's layout", isa, e)
        return KV_LAYOUT_ROWS
    written = torch.stack([key, value], dim=2)  # [n, kv_heads, 2, head_dim]
    for layout in KERNEL_LAYOUTS:
        if layout == KV_LAYOUT_CPU_ATTN_AMX and (block_size % 16 or head_size % 16):
            continue  # its index arithmetic needs both in multiples of 16 (the AMX ISA itself asks for 32)
        elements = cpu_attn_elements(slots // block_size, slots % block_size, kvh, block_size, head_size, layout)
        if torch.equal(cache.flatten()[elements], written):
            return layout
    logger.warning("vllm-ddtree: CPU_ATTN's cache layout for ISA %s (%s, block %d, head size %d) is not the one "
                   "its tree steps read back; every step uses SDPA and vllm-ddtree's layout", isa, dtype, block_size,
                   head_size)
    return KV_LAYOUT_ROWS


def cache_isa(dtype: torch.dtype, block_size: int, head_size: int, layer=None) -> str:
    """The CPU_ATTN ISA of a layer: what vLLM's builder set on it, else what it would choose."""
    return getattr(layer, "isa", None) or _get_attn_isa(dtype, block_size, head_size)


def cache_layout(kv_cache: Tensor, layer=None) -> str:
    """The layout (:func:`kv_layout`) of a layer cache [blocks, kv_heads, block_size, 2 * head_dim]."""
    _, _, bs, two_hd = kv_cache.shape
    return kv_layout(kv_cache.dtype, bs, two_hd // 2, cache_isa(kv_cache.dtype, bs, two_hd // 2, layer))


@dataclass
class TreeAttentionMetadata:
    """Per-step metadata shared by every layer of a KV-cache group."""

    num_actual_tokens: int
    query_start_loc: Tensor  # [R + 1]
    seq_lens: Tensor  # [R] kv length after this step's tokens
    slot_mapping: Tensor  # [T] where each new token's K/V is written
    kv_rows: Tensor | None  # "rows" layout: [R * kv_heads * 2 * max_kv] cache rows of (request, kv head, K|V, position)
    query_index: Tensor  # [R, max_q] flat token index of query i of request r (0 where padding)
    query_valid: Tensor  # [R, max_q]
    valid_queries: Tensor  # [n] flat indices into [R * max_q] of the real queries (not padding)
    valid_tokens: Tensor  # [n] their token indices (query_index at valid_queries)
    mask: Tensor  # [R, 1, max_q, max_kv] bool, True = may attend
    causal: bool | Tensor = True  # what the caller asked for (the DFlash drafter checks `causal is False`)
    max_query_len: int = 0
    max_seq_len: int = 0  # the KV length attended: max_kv ("rows"), whole blocks (CPU_ATTN's layouts)
    kv_blocks: Tensor | None = None  # a CPU_ATTN layout: [R * blocks] the cache blocks of each request, in order
    kv_layout: str = KV_LAYOUT_ROWS  # the cache's layout (`kv_layout`)
    _folded: dict = field(default_factory=dict)  # query-heads-per-KV-head G -> [R, 1, G * max_q, max_kv]
    # A step that mixes long query runs (prefill chunks) with short ones (decodes, tree rows) is
    # attended in parts, each padded to its own longest query (see `SEPARATE_QUERY_LEN`); empty: one part.
    parts: list = field(default_factory=list)
    # Requests of a verify step without a tree (decodes, prefill chunks): CPU_ATTN's metadata for them
    # as a batch of their own and the step's token index of its queries [n], or None.
    kernel_part: tuple[CPUAttentionMetadata, Tensor] | None = None

    def folded_mask(self, group: int) -> Tensor:
        """The mask for queries folded as [R, kv_heads, group * max_q] (query head-major within a
        KV head's group): the same [max_q, max_kv] block for each of the group's heads. Built by the
        first layer of the step and shared by the rest."""
        if group not in self._folded:
            r, _, q, kv = self.mask.shape
            self._folded[group] = self.mask[:, :, None].expand(r, 1, group, q, kv).reshape(r, 1, group * q, kv)
        return self._folded[group]


#: A request with more queries than this in a step (a prefill chunk) is attended on its own. Padding
#: every request to the longest query of the step would make a 2048-token chunk next to 20 decodes
#: cost 21 chunks' attention; tree rows (at most 1 + verify width) and decodes stay in one batch.
SEPARATE_QUERY_LEN = 128


class TreeAttentionMetadataBuilder(AttentionMetadataBuilder[TreeAttentionMetadata | CPUAttentionMetadata]):
    """Per step, for all layers of a KV-cache group: vLLM's CPU_ATTN metadata when the step has no tree
    masks for these layers and the cache is in CPU_ATTN's layout, else the gather indices and masks."""

    split_steps = 0  # verify steps built in this process whose requests without a tree go to the kernel

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        # vLLM's builder (it also sets each layer's `isa`, which its kernel and cache writes read)
        self.stock = CPUAttentionMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device) if vllm_config else None
        # the layout the impl's cache writes use (`cache_layout`): decided by the same probe
        dtype, head_size = kv_cache_spec.dtype, kv_cache_spec.head_size
        isa = self.stock.isa if self.stock is not None else _get_attn_isa(dtype, self.block_size, head_size)
        self.layout = kv_layout(dtype, self.block_size, head_size, isa)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> TreeAttentionMetadata | CPUAttentionMetadata:
        cm = common_attn_metadata
        r = cm.num_reqs
        tree = step_tree_masks_for(self.layer_names, r)
        kernel = self.stock is not None and self.layout in KERNEL_LAYOUTS and STOCK_KERNEL_FOR_PLAIN_STEPS
        if tree is None and kernel:
            return self.stock.build(common_prefix_len, cm, fast_build)
        qsl = cm.query_start_loc[: r + 1].long()
        seq_lens = cm.seq_lens[:r].long()
        query_lens = qsl[1:] - qsl[:-1]
        causal = cm.causal
        causal_t = causal.bool()[:r] if isinstance(causal, Tensor) else torch.full((r,), bool(causal))
        blocks = cm.block_table_tensor[:r].long()
        kernel_part = None
        if kernel and bool(causal_t.all()):  # a verify step: only its trees need SDPA (host tensors on a CPU)
            has_tree = tree.has_tree.cpu() & ~chain_trees(tree).cpu()  # a one-path tree's mask is causal
            trees, plain = has_tree.nonzero().flatten(), (~has_tree).nonzero().flatten()
            if not trees.numel():
                return self.stock.build(common_prefix_len, cm, fast_build)
            groups = [trees]
            if plain.numel():
                kernel_part = self._kernel_part(plain, qsl, query_lens, seq_lens, cm)
                TreeAttentionMetadataBuilder.split_steps += 1
        else:
            long_runs = (query_lens > SEPARATE_QUERY_LEN).nonzero().flatten().tolist()  # host tensors on a CPU
            if not long_runs or len(long_runs) == r == 1:
                groups = [None]  # one part: every request, as before
            else:
                short = (query_lens <= SEPARATE_QUERY_LEN).nonzero().flatten()
                groups = ([short] if short.numel() else []) + [torch.tensor([i]) for i in long_runs]
        parts = [self._part(idx, qsl, query_lens, seq_lens, causal_t, blocks, tree, causal, cm) for idx in groups]
        if len(parts) == 1 and kernel_part is None and groups[0] is None:
            return parts[0]
        whole = parts[0]
        return TreeAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens, query_start_loc=qsl, seq_lens=seq_lens,
            slot_mapping=cm.slot_mapping, kv_rows=whole.kv_rows, kv_blocks=whole.kv_blocks, query_index=whole.query_index,
            query_valid=whole.query_valid, valid_queries=whole.valid_queries, valid_tokens=whole.valid_tokens,
            mask=whole.mask, causal=causal, max_query_len=int(cm.max_query_len), max_seq_len=int(cm.max_seq_len),
            parts=parts, kernel_part=kernel_part)

    def _kernel_part(self, idx: Tensor, qsl: Tensor, query_lens: Tensor, seq_lens: Tensor,
                     cm: CommonAttentionMetadata) -> tuple[CPUAttentionMetadata, Tensor]:
        """CPU_ATTN's metadata for the requests `idx` of the step (causal, no tree) as a batch of their
        own, by vLLM's builder, and the step's token index [n] of that batch's queries."""
        lens = query_lens[idx]
        sub_qsl = torch.zeros(idx.numel() + 1, dtype=torch.long)
        torch.cumsum(lens, 0, out=sub_qsl[1:])
        n = int(sub_qsl[-1])
        tokens = torch.repeat_interleave(qsl[:-1][idx] - sub_qsl[:-1], lens) + torch.arange(n)
        sub_qsl = sub_qsl.int()  # the kernel's index types, as vLLM's runner hands them over
        sub = CommonAttentionMetadata(
            query_start_loc=sub_qsl, query_start_loc_cpu=sub_qsl, seq_lens=seq_lens[idx].int(), num_reqs=idx.numel(),
            num_actual_tokens=n, max_query_len=int(lens.max()), max_seq_len=int(seq_lens[idx].max()),
            block_table_tensor=cm.block_table_tensor[idx].int(), slot_mapping=cm.slot_mapping[tokens], causal=True)
        return self.stock.build(0, sub), tokens

    def _part(self, idx: Tensor | None, qsl: Tensor, query_lens: Tensor, seq_lens: Tensor, causal_t: Tensor,
              blocks: Tensor, tree: TreeStepMasks | None, causal, cm: CommonAttentionMetadata) -> TreeAttentionMetadata:
        """The metadata of the requests `idx` (None: all of them), padded to their own longest query and KV."""
        if idx is not None:
            starts, query_lens, seq_lens = qsl[:-1][idx], query_lens[idx], seq_lens[idx]
            causal_t, blocks = causal_t[idx], blocks[idx]
            if tree is not None:
                tree = TreeStepMasks(tree.has_tree[idx.to(tree.has_tree.device)], tree.num_rows[idx.to(tree.num_rows.device)],
                                     tree.ancestors[idx.to(tree.ancestors.device)], tree.layer_prefix)
            max_q, max_kv = max(int(query_lens.max()), 1), max(int(seq_lens.max()), 1)
        else:
            starts = qsl[:-1]
            max_q, max_kv = max(int(cm.max_query_len), 1), max(int(cm.max_seq_len), 1)
        r = query_lens.shape[0]
        kv_rows = kv_blocks = None
        if self.layout in KERNEL_LAYOUTS:  # whole blocks are gathered: K and V are permuted within each
            num_blocks = -(-max_kv // self.block_size)
            max_kv = num_blocks * self.block_size
            kv_blocks = blocks[:, :num_blocks].reshape(-1)
        else:
            p = torch.arange(max_kv)
            kv_block = blocks.gather(1, (p // self.block_size).clamp(max=blocks.shape[1] - 1).expand(r, max_kv))
            kv_offset = (p % self.block_size).expand(r, max_kv)
            rows = cache_rows(kv_block, kv_offset, self.num_kv_heads, self.block_size)  # [R, max_kv, kv_heads, 2]
            kv_rows = rows.permute(0, 2, 3, 1).reshape(-1)
        i = torch.arange(max_q)
        query_valid = i.view(1, -1) < query_lens.view(-1, 1)
        query_index = torch.where(query_valid, starts.view(-1, 1) + i.view(1, -1), 0)
        mask = build_attention_mask(query_lens, seq_lens, causal_t, max_q, max_kv, tree)
        valid = query_valid.reshape(-1).nonzero().squeeze(1)
        return TreeAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            slot_mapping=cm.slot_mapping,
            kv_rows=kv_rows,
            kv_blocks=kv_blocks,
            query_index=query_index,
            query_valid=query_valid,
            valid_queries=valid,
            valid_tokens=query_index.reshape(-1)[valid],
            mask=mask[:, None],
            causal=causal,
            max_query_len=max_q,
            max_seq_len=max_kv,
            kv_layout=self.layout,
        )


class TreeAttentionImpl(AttentionImpl):
    """CPU_ATTN's forward for its metadata, SDPA over the paged cache with the builder's mask for
    ours; same constructor as CPU_ATTN's impl."""

    layers_served = 0  # attention layers built in this process (observability, tests)
    # The last cache update's rows, shared by all layers (_update_rows): (slots, (kv heads, block size), valid, rows).
    _rows_cache: tuple | None = None

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: Tensor | None = None,
    ) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "sliding window": sliding_window not in (None, -1),
            "logits soft-cap": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "a quantized KV cache": kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        missing = [name for name, bad in unsupported.items() if bad]
        if missing:
            raise NotImplementedError(
                f"vllm-ddtree's CPU tree attention does not support {', '.join(missing)}, so speculative "
                "method 'ddtree' cannot run this model on the CPU; use another speculative method or none"
            )
        TreeAttentionImpl.layers_served += 1
        if TreeAttentionImpl.layers_served == 1:
            logger.info("vllm-ddtree: CPU tree attention in use (vLLM's CPU_ATTN kernel for steps without trees, "
                        "PyTorch SDPA with per-request tree masks for verify steps)")
        # vLLM's own impl for the steps its metadata describes; it reads the current vLLM config,
        # which exists inside an engine (not in a bare unit test, which never builds its metadata)
        from vllm.config import get_current_vllm_config_or_none

        self.stock = None
        if get_current_vllm_config_or_none() is not None:
            self.stock = CPUAttentionBackendImpl(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                                                 sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                                                 kv_sharing_target_layer_name, sinks)
        self.kv_cache_dtype = kv_cache_dtype
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type

    def do_kv_cache_update(self, layer, key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
        """Write new tokens' K/V [n, kv_heads, hd] at `slot_mapping` (block * block_size + offset)."""
        _, num_kv_heads, bs, two_hd = kv_cache.shape
        n = min(slot_mapping.shape[0], key.shape[0])
        if cache_layout(kv_cache, layer) in KERNEL_LAYOUTS:
            write_cpu_attn_kv(key[:n], value[:n], kv_cache, slot_mapping[:n], cache_isa(kv_cache.dtype, bs, two_hd // 2, layer),
                              self.kv_cache_dtype, getattr(layer, "_k_scale_float", 1.0), getattr(layer, "_v_scale_float", 1.0))
            return
        kv = torch.stack([key[:n], value[:n]], dim=2).to(kv_cache.dtype)  # [n, kv_heads, 2, hd]
        valid, rows = self._update_rows(slot_mapping, n, num_kv_heads, bs)
        if valid is not None:
            kv = kv[valid]
        kv_cache.view(-1, two_hd // 2).index_copy_(0, rows, kv.reshape(-1, two_hd // 2))

    def _update_rows(self, slot_mapping: Tensor, n: int, num_kv_heads: int, block_size: int):
        """(valid tokens or None if all are, their cache rows [n * kv_heads * 2]) for `slot_mapping`.

        Every layer of a step gets the same slots: the rows are computed by the first layer and
        reused by the others (one comparison of the slots instead of ~15 small ops per layer).
        """
        shape = (num_kv_heads, block_size)
        cached = TreeAttentionImpl._rows_cache
        if cached is not None and cached[1] == shape and torch.equal(cached[0], slot_mapping[:n]):
            return cached[2], cached[3]
        kept = slot_mapping[:n].clone()  # a copy: the runner rewrites its slot buffer every step
        slots = kept.long()
        valid = slots >= 0  # padded tokens carry slot -1: drop them (a CPU-side filter is cheap here)
        if bool(valid.all()):
            valid = None
        else:
            slots = slots[valid]
        rows = cache_rows(slots // block_size, slots % block_size, num_kv_heads, block_size).reshape(-1)
        TreeAttentionImpl._rows_cache = (kept, shape, valid, rows)
        return valid, rows

    def forward(
        self,
        layer,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        attn_metadata: TreeAttentionMetadata | None,
        output: Tensor,
        output_scale: Tensor | None = None,
        output_block_scale: Tensor | None = None,
    ) -> Tensor:
        """query [T, heads, hd] -> output [T, heads, hd] (or [T, heads * hd])."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the CPU tree attention")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        if isinstance(attn_metadata, CPUAttentionMetadata):  # no tree in this step: vLLM's kernel
            return self.stock.forward(layer, query, key, value, kv_cache, attn_metadata, output)
        for md in attn_metadata.parts or [attn_metadata]:
            self._attend(md, query, kv_cache, output)
        if attn_metadata.kernel_part is not None:  # the step's requests without a tree: vLLM's kernel
            kernel_md, tokens = attn_metadata.kernel_part
            part_out = output.new_empty((tokens.shape[0], *output.shape[1:]))
            self.stock.forward(layer, query.index_select(0, tokens), key, value, kv_cache, kernel_md, part_out)
            output.index_copy_(0, tokens, part_out)
        return output

    def _attend(self, md: TreeAttentionMetadata, query: Tensor, kv_cache: Tensor, output: Tensor) -> None:
        """One part's attention: its queries' outputs written into `output`."""
        r, max_q = md.query_index.shape
        kvh, hd, group = self.num_kv_heads, self.head_size, self.num_heads // self.num_kv_heads
        if md.kv_blocks is not None:  # a CPU_ATTN layout: whole blocks, K and V together, then SDPA's order
            nb, _, bs, _ = kv_cache.shape
            blocks = kv_cache.view(nb, kvh, 2, bs * hd).index_select(0, md.kv_blocks).view(r, -1, kvh, 2, bs * hd)
            k, v = unpack_blocks(blocks, md.kv_layout, bs, hd)
        else:
            kv = kv_cache.view(-1, hd).index_select(0, md.kv_rows).view(r, kvh, 2, md.max_seq_len, hd)
            k, v = kv[:, :, 0], kv[:, :, 1]
        # [R, max_q, heads, hd] -> [R, kv_heads, group * max_q, hd]: a KV head's query heads become
        # query rows of one attention (GQA without repeating K/V; the mask is repeated instead).
        q = query.index_select(0, md.query_index.reshape(-1)).view(r, max_q, self.num_heads, hd)
        q = q.permute(0, 2, 1, 3).reshape(r, kvh, group * max_q, hd)
        out = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=md.folded_mask(group), scale=self.scale
        )  # [R, kv_heads, group * max_q, hd]
        out = out.view(r, self.num_heads, max_q, hd).transpose(1, 2).reshape(r * max_q, self.num_heads, hd)
        flat = output.view(output.shape[0], self.num_heads, hd)
        flat.index_copy_(0, md.valid_tokens, out.index_select(0, md.valid_queries).to(flat.dtype))


class TreeAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN's capabilities and cache shape, our impl and builder. Named CPU_ATTN on purpose:
    `get_name()` must name an AttentionBackendEnum member and this backend is registered over it."""

    @staticmethod
    def get_impl_cls() -> type[TreeAttentionImpl]:
        return TreeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeAttentionMetadataBuilder]:
        return TreeAttentionMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


def register() -> None:
    """Make the CPU platform's CPU_ATTN resolve to this backend (vllm.v1.attention.backends.registry)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.TreeAttentionBackend")

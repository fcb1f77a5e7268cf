"""Draft-tree core: build, score, budget, compile, verify. Pure PyTorch, batched, device-agnostic.

No vLLM imports here: the same code serves the reference decoder, the CPU engine and the GPU path.
"""

from .acceptance import AcceptanceCalibration, LookupCalibration
from .allocate import BudgetPlan, allocate_batch, batch_estimate, choose_budgets, node_gains, path_gains
from .budget import AutoBudget
from .cost import PROFILES, CostCalibration, CostModel, DeviceProfile, ModelShape, get_profile, roofline_seconds
from .gate import SpeculationGate
from .build import (
    NO_PARENT,
    DraftTree,
    HostTrees,
    add_branch,
    PrefixScorer,
    build_tree,
    build_tree_reference,
    check_draft_inputs,
    head_topk,
    topk_per_depth,
    tree_to_host,
)
from .compile import (
    FlashInferTreeMask,
    KVCompaction,
    CHAIN,
    SCHEDULE_FIELDS,
    ScheduledRows,
    TreeBatch,
    ancestor_mask,
    apply_compaction_,
    compaction_plan,
    path_row_moves,
    compile_tree,
    dense_attention_mask,
    flashinfer_tree_mask,
    scheduled_rows,
)
from .transfer import HostReads, to_device, to_device_together, to_host
from .ngram import HostTokens, NGramCounts, NGramModel, NGramScorer, build_corpus_ngram, entropy_adaptive_lambda, windows_of
from .lookup import TokenHistory
from .graphs import StepGraphs
from .step import (capture_width, draft_trees, first_rows, first_scheduled, first_verified, padded_rows, padded_width,
                   plan_trees, plan_trees_with_lookup, schedule_rows, verify_trees)
from .verify import (PathSlotMoves, VerifiedStep, WalkResult, greedy_tokens, path_slot_moves, sample_tokens, verify_step,
                     walk_tree)

__all__ = [name for name in dir() if not name.startswith("_")]

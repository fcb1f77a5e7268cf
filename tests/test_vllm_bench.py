"""The benchmark use, run from the examples: `vllm bench throughput` with ddtree on random prompts.

Runs ``examples/bench_throughput.sh`` (``vllm bench throughput --model <target> --speculative-config
'{"method": "ddtree", ...}' --dataset-name random``, nothing downloaded) with a handful of prompts and
checks that it finishes, prints its throughput line and JSON, and that the engine ran ddtree (its
speculative config in the engine core's log, and drafts in any spec-decode metrics line logged).
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "checkpoints" / "smollm2-dflash"
NUM_PROMPTS = 4


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> Path:
    if (TRAINED / "config.json").is_file():
        return TRAINED
    import torch

    from vllm_ddtree.drafter import DFlashDrafter, DrafterConfig, save_drafter, target_embeddings
    from vllm_ddtree.models.target import prepare_target

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("drafter")
    cfg = DrafterConfig(target_layer_ids=[1, 15, 27])
    save_drafter(DFlashDrafter(cfg, target_embeddings(prepare_target())), out, dtype=torch.float32)
    return out


def test_bench_throughput_with_ddtree(tmp_path, drafter):
    out_json = tmp_path / "bench.json"
    env = dict(os.environ, PYTHON=sys.executable, DRAFTER=str(drafter), VLLM_CPU_KVCACHE_SPACE="1",
               NUM_PROMPTS=str(NUM_PROMPTS), INPUT_LEN="32", OUTPUT_LEN="32", TREE_BUDGET="8")
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    if lib.exists():
        env["LD_PRELOAD"] = str(lib)
    proc = subprocess.Popen(["bash", str(ROOT / "examples" / "bench_throughput.sh"), "--output-json", str(out_json)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"^Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, [\d.]+ output tokens/s", out, re.M), out[-4000:]
    res = json.loads(out_json.read_text())
    assert res["num_requests"] == NUM_PROMPTS and res["requests_per_second"] > 0, res
    # The engine core unpickled and logged a ddtree config: the plugin registered in that process too.
    assert "speculative_config=SpeculativeConfig(method='ddtree'" in out, out[-4000:]
    drafted = [int(n) for n in re.findall(r"SpecDecoding metrics: .*Drafted: (\d+) tokens", out)]
    assert all(n > 0 for n in drafted), drafted  # logged every few seconds; a short run may log none

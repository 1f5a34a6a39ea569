"""The plot of a run: loss (and eval loss), LR, tokens/s/GPU, MFU and memory against the step, from its
metrics.jsonl, as one PNG beside it. A tool: nothing the trainer imports.

    python tools/plot.py OUT_DIR          (or `python train.py --plot OUT_DIR`, which runs this)
"""
import json
import os
import sys


def plot_metrics(out_dir: str) -> str:
    """Loss (and eval loss), LR, tokens/s/GPU, MFU and memory against the step, as one PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise RuntimeError(f"--plot: {path} does not exist")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    by_source = sorted({key for r in rows for key in r if key.startswith("eval_loss/")})  # a mix's sources
    panels = [("loss", ["loss", "eval_loss", *by_source]), ("learning rate", ["lr"]),
              ("tokens/s/GPU", ["tokens_per_sec_per_gpu"]), ("MFU", ["mfu"]), ("peak memory (GB)", ["mem_gb"])]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True)
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), label=key, marker="." if len(points) < 50 else None)
            elif key == keys[0]:
                ax.text(0.5, 0.5, "not recorded (MFU needs a GPU with a known peak)" if key == "mfu"
                        else "not recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    png = os.path.join(out_dir, "metrics.png")
    fig.savefig(png, dpi=100)
    return png


def main(argv: list[str]) -> int:
    """Draws OUT_DIR's metrics and says where; a missing file or matplotlib is one line, exit code 2."""
    if len(argv) != 1:
        print("usage: python tools/plot.py OUT_DIR", file=sys.stderr)
        return 2
    try:
        print(f"wrote {plot_metrics(argv[0])}", flush=True)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

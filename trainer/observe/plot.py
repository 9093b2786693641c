"""`meshtrain plot RUN_DIR [RUN_DIR...] --out FILE.png`: loss, eval loss, eval bits/byte, tokens/s and MFU of
runs, overlaid (bits per byte compare runs whose tokenizers differ; nats per token do not)."""
from __future__ import annotations

import json
from pathlib import Path

from trainer.config.paths import check
from trainer.data import remote
from trainer.errors import UserError

PANELS = (("loss", "train loss (nats/token)"), ("eval_loss", "eval loss (nats/token)"),
          ("eval_bpb", "eval bits/byte"), ("tokens_per_sec", "tokens/s"), ("mfu", "MFU"))


def _metrics_text(run_dir) -> str:
    check(str(run_dir), "RUN_DIR")
    url = remote.is_url(str(run_dir))
    path = remote.join(str(run_dir), "metrics.jsonl") if url else Path(run_dir) / "metrics.jsonl"
    if not (remote.exists(path) if url else path.is_file()):
        raise UserError(f"'{run_dir}' has no metrics.jsonl; give the run.dir of a run that has logged steps")
    return remote.read_bytes(path).decode() if url else path.read_text()


def read_metrics(run_dir) -> list[dict]:
    """A run's metrics.jsonl records (a run.dir on disk or in a bucket) merged per step (later lines win), in step
    order."""
    by_step: dict[int, dict] = {}
    for line in _metrics_text(run_dir).splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if isinstance(rec, dict) and "step" in rec:
            by_step.setdefault(rec["step"], {}).update(rec)
    return [by_step[k] for k in sorted(by_step)]


def series(records: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(run_dirs: list[str], out: str) -> dict[str, int]:
    """Write the figure to `out`; returns how many runs each panel shows."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("meshtrain plot needs matplotlib; install it: pip install matplotlib") from None
    if not run_dirs:
        raise UserError("give at least one RUN_DIR: meshtrain plot RUN_DIR [RUN_DIR...] --out FILE.png")
    check(out, "--out")
    runs = [(str(d), read_metrics(d)) for d in run_dirs]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), sharex=True)
    axes.flat[-1].set_visible(False)  # five panels
    shown = {}
    for ax, (key, title) in zip(axes.flat, PANELS):
        shown[key] = 0
        for i, (name, recs) in enumerate(runs):
            x, y = series(recs, key)
            if x:
                ax.plot(x, y, color=f"C{i}", label=name, marker="." if len(x) < 30 else None)
                shown[key] += 1
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if not shown[key]:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes[1][:2]) + [axes[0][2]]:  # the bottom of each column
        ax.set_xlabel("step")
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    try:
        _save(fig, out)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot write the plot to '{out}' ({e}); give a writable --out path ending in .png") from None
    finally:
        plt.close(fig)
    return shown


def _save(fig, out: str):
    """The figure written to `out`: a file, or an object (one PUT of the image drawn in memory)."""
    if not remote.is_url(out):
        fig.savefig(out, dpi=100)
        return
    import io
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format=Path(out).suffix[1:] or "png")
    remote.write_bytes(out, buf.getvalue())

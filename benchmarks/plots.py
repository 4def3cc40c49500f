"""Figures of the benchmark: lean's speedup over each peer per sweep (the paper's Figures 7-9 are the
context, heads and batch panels) and the bandwidth each peer reaches as a share of copy bandwidth."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SWEEP_TITLES = {
    "context": "context length",
    "heads": "heads (256k context)",
    "batch": "batch (16k context)",
    "ragged": "mean / max length",
    "models": "model (batch 8, 8k)",
    "gqa": "query heads per KV head",
}


def _peers(rows: list[dict]) -> list[str]:
    return sorted({k.removeprefix("speedup_vs_") for r in rows for k in r if k.startswith("speedup_vs_")})


def plot_all(rows: list[dict], env: dict, out_dir: str) -> list[str]:
    """Write speedup.png and bandwidth.png (one line per peer and dtype); returns the paths."""
    sweeps = [s for s in SWEEP_TITLES if any(r["sweep"] == s for r in rows)]
    if not sweeps:
        return []
    title = f"{env.get('device', '?')}, {env.get('date', '')}, commit {env.get('commit', '?')}"
    paths = []
    for kind in ("speedup", "bandwidth"):
        cols = min(3, len(sweeps))
        fig, axes = plt.subplots(
            -(-len(sweeps) // cols), cols, figsize=(5 * cols, 3.8 * -(-len(sweeps) // cols)), squeeze=False
        )
        for ax, sweep in zip(axes.flat, sweeps):
            _panel(ax, [r for r in rows if r["sweep"] == sweep], kind, sweep)
        for ax in list(axes.flat)[len(sweeps) :]:
            ax.axis("off")
        fig.suptitle(
            ("Lean speedup over each peer" if kind == "speedup" else "Achieved bandwidth, % of copy") + f" ({title})"
        )
        fig.tight_layout()
        path = os.path.join(out_dir, f"{kind}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _panel(ax, rows: list[dict], kind: str, sweep: str) -> None:
    labels = list(dict.fromkeys(r["x"] for r in rows))
    series = _peers(rows) if kind == "speedup" else ["lean"] + _peers(rows)
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for peer in series:
            key = f"speedup_vs_{peer}" if kind == "speedup" else f"{peer}_pct_copy"
            points = [
                (labels.index(r["x"]), float(r[key]))
                for r in rows
                if r["dtype"] == dtype and r.get(key) not in (None, "")
            ]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{'vs ' if kind == 'speedup' else ''}{peer} ({dtype})")
    if kind == "speedup":
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_yscale("log")  # ratios: 2x faster and 2x slower sit at equal distances from 1
    ax.set_xticks(range(len(labels)), labels, rotation=45 if sweep == "models" else 0, fontsize=8)
    ax.set_xlabel(SWEEP_TITLES[sweep])
    ax.set_ylabel("speedup (x)" if kind == "speedup" else "% of copy bandwidth")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)

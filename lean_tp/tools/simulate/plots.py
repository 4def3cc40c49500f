"""The simulator's charts: one problem's schedule as a Gantt chart, and the sweeps' speedups."""

from __future__ import annotations

import math

from lean_tp.tools.gpus import GPUModel
from lean_tp.tools.simulate.problems import Problem
from lean_tp.tools.simulate.schedules import Schedule
from lean_tp.tools.simulate.tables import taking_peer_ratios


def plot_gantt(problem: Problem, gpu: GPUModel, result: dict[str, Schedule], path: str) -> None:
    """Lean next to FA2's fixed split (``result`` of ``simulate``): one row per SM, one bar per
    piece of work, colored by output."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    horizon = max(result["lean"].makespan, result["fa2"].makespan)
    fig, axes = plt.subplots(1, 2, figsize=(14, max(4, gpu.sms * 0.06)), sharey=True)
    cmap = plt.get_cmap("tab20")
    for ax, name in zip(axes, ("lean", "fa2")):
        sched = result[name]
        for sm, start, tokens, output in sched.bars:
            ax.barh(sm, tokens, left=start, height=0.9, color=cmap(output % 20), edgecolor="white", linewidth=0.3)
        ax.axvline(sched.makespan, color="red", linewidth=1.5, label="finish (makespan)")
        title = (
            "LeanAttention (stream-K)" if name == "lean" else f"FlashDecoding / FA2 fixed split ({sched.splits} splits)"
        )
        ax.set_title(
            f"{title}\nload balance {sched.efficiency:.2f} over the {sched.busy_sms} SMs with work, "
            f"modelled {sched.time_us:.1f} us"
        )
        ax.set_xlim(0, horizon * 1.02)
        ax.set_xlabel("K/V tokens read per SM")
    axes[0].set_ylabel(f"SM ({gpu.name}, {gpu.sms} SMs)")
    axes[0].invert_yaxis()
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(
        f"{problem.describe()}\nbar: one piece of work, its length the K/V tokens it reads; colour: the "
        "output (sequence, KV head) it belongs to, so one colour on several SMs is a split output"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rows: list[dict], path: str) -> None:
    """Modelled FA2 time over lean time against context: one panel per (GPU, preset model), one
    line per batch size, each in its own colour and marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus, models = sorted({r["gpu"] for r in rows}), sorted({r["model"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(
        len(gpus), len(models), figsize=(3.6 * len(models), 3.2 * len(gpus)), sharex=True, sharey=True, squeeze=False
    )
    for i, gpu in enumerate(gpus):
        for j, model in enumerate(models):
            ax = axes[i][j]
            for k, batch in enumerate(batches):
                points = sorted(
                    (r["context"], r["speedup_vs_fa2"])
                    for r in rows
                    if (r["gpu"], r["model"], r["batch"]) == (gpu, model, batch)
                )
                if points:
                    ax.plot(*zip(*points), color=f"C{k}", marker="os^Dv"[k % 5], markersize=3, label=f"B={batch}")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{gpu}, {model}", fontsize=9)
            if i == len(gpus) - 1:
                ax.set_xlabel("context (tokens)")
        axes[i][0].set_ylabel("FA2 time / lean time")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="center right", fontsize=8, title="batch")
    fig.suptitle(
        f"One rank of TP={rows[0]['tp']}: FlashDecoding (FA2) over lean, modelled, merges counted (> 1: lean faster)"
    )
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cp_sweep(rows: list[dict], path: str, model: str = "llama-3-70b") -> None:
    """KV memory and modelled attention time per rank against context for ``model`` on the first
    GPU's rows: one row of panels per batch size (the smallest and the largest), one colour,
    marker and line style per layout, so that layouts with equal values stay visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = rows[0]["gpu"]
    mine = [r for r in rows if r["gpu"] == gpu and r["model"] == model]
    batches = sorted({min(r["batch"] for r in mine), max(r["batch"] for r in mine)})
    layouts = sorted({(r["gpus"], r["tp"], r["cp"]) for r in mine})
    fig, axes = plt.subplots(len(batches), 2, figsize=(13, 4 * len(batches)), sharex=True, squeeze=False)
    panels = (
        ("kv_gb_per_rank", "KV cache per rank (GB, all layers)"),
        ("attention_us", "attention per layer per rank (us)"),
    )
    for row, batch in zip(axes, batches):
        for ax, (key, label) in zip(row, panels):
            drawn: list[tuple[str, list]] = []
            for i, (gpus, tp, cp) in enumerate(layouts):
                points = sorted(
                    (r["context"], r[key])
                    for r in mine
                    if (r["gpus"], r["tp"], r["cp"], r["batch"]) == (gpus, tp, cp, batch)
                )
                name = f"{gpus} GPUs, TP {tp} x CP {cp}"
                # A layout whose values equal an earlier one's lies under it: the legend says so.
                same = [
                    n for n, pts in drawn if all(math.isclose(a[1], b[1], rel_tol=0.01) for a, b in zip(pts, points))
                ]
                drawn.append((name, points))
                # Drawn wide to narrow, hollow markers: a layout under another still shows its edge.
                ax.plot(
                    *zip(*points),
                    ("-", "--", ":", "-.")[i % 4],
                    color=f"C{i}",
                    marker="osD^v<>"[i % 7],
                    markersize=7 - i,
                    markerfacecolor="none",
                    linewidth=2.5 - 0.3 * i,
                    label=name + (f" (= {same[0].split(', ')[1]})" if same else ""),
                )
            ax.legend(fontsize=7)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.set_title(f"B={batch}", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("context (tokens)")
    fig.suptitle(f"{model} on {gpu}: one rank, TP alone against TP x CP (CP exchange counted, modelled)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_mla_sweep(rows: list[dict], path: str) -> None:
    """The fastest MLA peer's modelled time over lean's against context, Tq = 1: one panel per (GPU,
    served rank), one colour per batch size, bf16 solid and fp8 dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["gpu"], r["model"], r["parallel"], r["heads"]) for r in rows})
    batches = sorted({r["batch"] for r in rows})
    cols = 4
    fig, axes = plt.subplots(
        math.ceil(len(panels) / cols), cols, figsize=(3.6 * cols, 3.2 * math.ceil(len(panels) / cols)),
        sharex=True, sharey=True, squeeze=False,
    )  # fmt: skip
    for ax, (gpu, model, parallel, heads) in zip(axes.flat, panels):
        for k, batch in enumerate(batches):
            for cache, style in (("bf16", "-"), ("fp8", "--")):
                mine = sorted(
                    (r for r in rows if (r["gpu"], r["model"], r["parallel"], r["batch"], r["cache"], r["tq"])
                     == (gpu, model, parallel, batch, cache, 1)),
                    key=lambda r: r["context"],
                )  # fmt: skip
                ax.plot(
                    [r["context"] for r in mine],
                    # NaN, no point, where no peer's code takes the row's cache
                    [min(taking_peer_ratios(r).values(), default=math.nan) for r in mine],
                    style,
                    color=f"C{k}",
                    marker="os^Dv"[k % 5],
                    markersize=3,
                    label=f"B={batch}" if cache == "bf16" else None,
                )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_title(f"{gpu}, {model} {parallel} ({heads} heads)", fontsize=9)
        ax.set_xlabel("context (tokens)")
    for ax in axes[:, 0]:
        ax.set_ylabel("fastest peer's time / lean's")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="center right", fontsize=8, title="batch")
    fig.suptitle(
        "MLA decode, modelled, Tq = 1: above 1 lean beats every peer that takes the cache (solid: bf16, dashed: fp8)"
    )
    fig.tight_layout(rect=(0, 0, 0.92, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --deterministic-sweep's engine modes: (row key prefix, label, line style, marker).
ENGINE_STYLES = (
    ("vllm", "vLLM batch-invariant (no split)", "-", "o"),
    ("sglang_flashinfer", "SGLang FlashInfer (2048-token splits)", "--", "s"),
    ("sglang_triton", "SGLang Triton (256-token splits)", ":", "^"),
)


def plot_deterministic_sweep(rows: list[dict], path: str) -> None:
    """Each engine's deterministic mode over lean's batch-invariant mode, modelled: per GPU, the TP-8
    rank against context (one colour per batch, one line style per engine) and the paper's shapes
    (one marker per engine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = [r for r in rows if r.get("table") != "verification"]
    gpus = sorted({r["gpu"] for r in rows})
    fig, axes = plt.subplots(len(gpus), 2, figsize=(15, 5.6 * len(gpus)), squeeze=False, sharey=True)
    for (left, right), gpu in zip(axes, gpus):
        tp8 = [r for r in rows if r["gpu"] == gpu and r["shapes"] != "paper"]
        for k, batch in enumerate(sorted({r["batch"] for r in tp8})):
            mine = sorted((r for r in tp8 if r["batch"] == batch), key=lambda r: r["context"])
            for engine, _, style, marker in ENGINE_STYLES:
                left.plot(
                    [r["context"] for r in mine],
                    [r[f"{engine}_over_invariant"] for r in mine],
                    style,
                    color=f"C{k}",
                    marker=marker,
                    markersize=4,
                    label=f"B={batch}" if engine == "vllm" else None,
                )
        left.set_xscale("log", base=2)
        left.set_xlabel("context (tokens)")
        left.set_title(f"{gpu}, {tp8[0]['shapes'] if tp8 else 'TP-8'} rank (Hq=8, Hkv=1)", fontsize=9)
        styles = [Line2D([], [], color="grey", linestyle=style, label=label) for _, label, style, _ in ENGINE_STYLES]
        left.legend(handles=[*left.get_legend_handles_labels()[0], *styles], fontsize=7, title="batch (colour)")
        paper = [r for r in rows if r["gpu"] == gpu and r["shapes"] == "paper"]
        for engine, label, _, marker in ENGINE_STYLES:
            right.plot(
                range(len(paper)), [r[f"{engine}_over_invariant"] for r in paper], marker, markersize=6, label=label
            )
        right.set_xticks(range(len(paper)), [r["problem"].replace(" D=128", "") for r in paper], rotation=60,
                         ha="right", fontsize=6)  # fmt: skip
        right.set_title(f"{gpu}, the paper's shapes", fontsize=9)
        right.legend(fontsize=7)
        for ax in (left, right):
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_yscale("log", base=2)
        left.set_ylabel("engine mode time / lean invariant time")
    fig.suptitle(
        "Deterministic decode, modelled: above 1 lean's batch-invariant mode is faster "
        "(solid: vLLM, dashed: SGLang FlashInfer, dotted: SGLang Triton)"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)

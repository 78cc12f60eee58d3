"""PNG plots of a bench report (matplotlib, Agg backend: no display needed).

- pareto.png: tokens/s per user against total tokens/s, one curve per mode, one point per
  concurrency (labelled); up and to the right is better.
- acceptance.png: per-position acceptance rate (fraction of steps whose draft i was accepted)
  for each speculative mode and dataset.
"""
from __future__ import annotations

import io
from pathlib import Path

from dflash_trt.bench.report import atomic_write_bytes
from dflash_trt.errors import BackendUnavailableError

MATPLOTLIB_PIP = "pip install matplotlib"


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise BackendUnavailableError(f"plots need matplotlib: `{MATPLOTLIB_PIP}` (or pass --no-plots)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def pareto_plot(sweep: list[dict], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    try:
        for mode in dict.fromkeys(p["mode"] for p in sweep):
            pts = sorted((p for p in sweep if p["mode"] == mode and p["total_tokens_per_s"]),
                         key=lambda p: p["concurrency"])
            xs = [p["total_tokens_per_s"] for p in pts]
            ys = [p["tokens_per_s_per_user"] for p in pts]
            ax.plot(xs, ys, marker="o", label=mode)
            for p, x, y in zip(pts, xs, ys):
                ax.annotate(f"c={p['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("total tokens/s")
        ax.set_ylabel("tokens/s per user")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        _save(fig, path)
    finally:
        plt.close(fig)
    return path


def acceptance_plot(curves: dict[str, list[float]], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    try:
        for label, rates in curves.items():
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0.0, 1.02)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if curves:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no speculative mode measured", ha="center", va="center", transform=ax.transAxes)
        _save(fig, path)
    finally:
        plt.close(fig)
    return path


def _held_out_panels(runs: dict[str, list[tuple[int, int, float]]], xlabels: tuple[str, str], path: Path, title: str,
                     draw) -> Path:
    """The two-panel held-out acceptance figure both training plots share: each run's points
    (x = p[0], y = p[2]) on the left, `draw(axes)` for the rest, large counts on the right axis as 250k / 1M."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.4), sharey=True)
    try:
        for label, points in runs.items():
            pts = sorted(points)
            axes[0].plot([p[0] for p in pts], [p[2] for p in pts], marker=".", label=label)
        draw(axes)
        from matplotlib.ticker import EngFormatter

        axes[1].xaxis.set_major_formatter(EngFormatter(sep=""))  # 250k, 1M: no overlapping 7-digit labels
        for ax, xlabel in zip(axes, xlabels):
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("held-out acceptance length (tau, drafts as-is)")
        if runs:
            axes[0].legend(fontsize=8)
        fig.suptitle(title)
        _save(fig, path)
    finally:
        plt.close(fig)
    return path


def lineage_plot(runs: dict[str, list[tuple[int, int, float]]], data: list[tuple[str, int, float]], path: Path,
                 title: str) -> Path:
    """Held-out acceptance length of successive training runs of one drafter: against cumulative
    optimizer steps, one segment per run (left), and each run's last figure against the response tokens
    its training data held (right). runs[label] = [(cumulative step, blocks seen, accept length)];
    data = [(label, response tokens, last accept length)] in run order."""
    def draw(axes):
        from matplotlib.ticker import EngFormatter

        axes[0].xaxis.set_major_formatter(EngFormatter(sep=""))
        axes[1].plot([d[1] for d in data], [d[2] for d in data], marker="o", color="0.3")
        for label, tokens, acc in data:
            axes[1].annotate(label, (tokens, acc), textcoords="offset points", xytext=(4, -10), fontsize=8)

    return _held_out_panels(runs, ("optimizer steps, all runs", "response tokens in the run's training data (end of run)"),
                            path, title, draw)


def write_plots(report: dict, out_dir: Path) -> list[str]:
    """Write the plots a report supports; returns their file names (relative to out_dir)."""
    names = []
    title = report["config"]["target_name"]
    if report["sweep"]:
        pareto_plot(report["sweep"], out_dir / "pareto.png", f"Pareto: {title}")
        names.append("pareto.png")
    curves = {k: v for k, v in report["per_position_acceptance"].items() if v}
    if not curves:
        curves = {f"{p['mode']} c={p['concurrency']}": p["per_position_acceptance"]
                  for p in report["sweep"] if p["per_position_acceptance"]}
    acceptance_plot(curves, out_dir / "acceptance.png", f"Acceptance per position: {title}")
    names.append("acceptance.png")
    return names


def training_curves_plot(runs: dict[str, list[tuple[int, int, float]]], path: Path, title: str) -> Path:
    """Held-out block acceptance length of drafter training runs: against optimizer steps (left) and
    against anchored blocks seen (right). runs[label] = [(step, blocks seen, accept length)]."""
    def draw(axes):
        for label, points in runs.items():
            pts = sorted(points)
            axes[1].plot([p[1] for p in pts], [p[2] for p in pts], marker=".", label=label)

    return _held_out_panels(runs, ("optimizer steps", "anchored blocks seen (steps x sequences x anchors)"), path, title,
                            draw)

"""Loss-curve plots (PNG). Drawn with matplotlib's Agg canvas directly, without pyplot: no display is
needed and the user's matplotlib backend is left alone."""

from __future__ import annotations

import os


def _figure(title: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    return fig, ax


def loss_curve(history: list[dict], path: str | os.PathLike, title: str = "training loss") -> str:
    """Train loss per step and held-out loss where evaluated (records with "loss" / "eval_loss")."""
    fig, ax = _figure(title)
    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    held = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    if train:
        ax.plot(*zip(*train), lw=1.0, label="train")
    if held:
        ax.plot(*zip(*held), "o-", lw=1.5, label="held-out")
    ax.legend()
    fig.savefig(path)
    return str(path)


def parity_curves(curves: dict[str, list[float]], path: str | os.PathLike, title: str) -> str:
    """One train-loss curve per recipe on shared axes and, below, each recipe's difference to
    bf16's loss at the same step (the curves overlap where the recipes agree; the difference shows
    by how much they do not)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6.5), dpi=110)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.set_title(title)
    top.set_ylabel("loss (nats per token)")
    base = curves.get("bf16")
    for i, (recipe, losses) in enumerate(curves.items()):
        steps = range(1, len(losses) + 1)
        top.plot(steps, losses, lw=1.0, label=recipe, color=f"C{i}")
        if base is not None and recipe != "bf16":
            bottom.plot(steps, [a - b for a, b in zip(losses, base)], lw=1.0, label=recipe, color=f"C{i}")
    bottom.axhline(0.0, color="gray", lw=0.8)
    bottom.set_ylabel("loss - bf16 loss")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path)
    return str(path)

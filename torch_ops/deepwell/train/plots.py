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
    """One train-loss curve per recipe on shared axes."""
    fig, ax = _figure(title)
    for recipe, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, lw=1.0, label=recipe)
    ax.legend()
    fig.savefig(path)
    return str(path)

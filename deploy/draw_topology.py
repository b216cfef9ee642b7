"""Draws docs/scale-out.png: the scale-out topology (clients, HAProxy, gateway replicas with
their engines, the shared Redis) and where a dead replica's sessions go.

    python deploy/draw_topology.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "scale-out.png"


def box(ax: plt.Axes, x: float, y: float, w: float, h: float, title: str, body: str,
        color: str, dead: bool = False) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", linewidth=1.5,
                                edgecolor="#555" if not dead else "#b22", facecolor=color,
                                linestyle="-" if not dead else "--"))
    ax.text(x + w / 2, y + h - 0.11, title, ha="center", va="top", fontsize=11,
            weight="bold")
    ax.text(x + w / 2, y + h - 0.36, body, ha="center", va="top", fontsize=8.5,
            linespacing=1.4)
    if dead:
        ax.plot([x, x + w], [y, y + h], color="#b22", linewidth=2)
        ax.plot([x, x + w], [y + h, y], color="#b22", linewidth=2)


def arrow(ax: plt.Axes, a: tuple[float, float], b: tuple[float, float], text: str = "",
          color: str = "#333", style: str = "-", rad: float = 0.0) -> None:
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=14, color=color,
                                 linewidth=1.4, linestyle=style,
                                 connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((a[0] + b[0]) / 2 + 0.08, (a[1] + b[1]) / 2, text, fontsize=8, color=color,
                ha="left", va="center")


def main() -> None:
    fig, ax = plt.subplots(figsize=(11, 7.2))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 7.2)
    ax.axis("off")

    box(ax, 0.4, 6.0, 4.6, 1.0, "browser (web UI)", "WebSocket /v1/ws?session=<id>", "#e8f0fe")
    box(ax, 6.0, 6.0, 4.6, 1.0, "OpenAI SDK / HTTP client",
        "POST /v1/chat/completions\nX-Session-Id: <id>", "#e8f0fe")
    box(ax, 2.2, 4.1, 6.6, 1.0, "HAProxy  (deploy/haproxy.cfg)",
        "balance hdr(X-Session-Id), hash-type consistent (from ?session= or the path if no\n"
        "header; round robin without a session) · GET /healthz every 1 s, down after 2 fails",
        "#fff4e0")
    replicas = [("replica r0", False), ("replica r1", True), ("replica r2", False)]
    for i, (name, dead) in enumerate(replicas):
        x = 0.4 + i * 3.6
        box(ax, x, 1.9, 3.0, 1.5, name, "gateway (Starlette, uvicorn)\n+ engine process\n"
            "KV blocks pinned per session", "#e9f7ec" if not dead else "#fbeaea", dead)
        arrow(ax, (5.5, 4.1), (x + 1.5, 3.45), style="--" if dead else "-",
              color="#b22" if dead else "#333")
    box(ax, 3.4, 0.1, 4.2, 1.1, "Redis (shared)",
        "session metadata + message history\n(AOF on); every acknowledged turn", "#f1eafa")
    for i in range(3):
        x = 0.4 + i * 3.6 + 1.5
        arrow(ax, (x, 1.9), (5.5 + (i - 1) * 1.2, 1.25), color="#777")
    arrow(ax, (2.7, 6.0), (4.5, 5.15))
    arrow(ax, (8.3, 6.0), (6.5, 5.15))
    ax.annotate("r1 dies: only its sessions move (consistent hash);\n"
                "their next turn re-prefills the history once on r0/r2,\n"
                "the turn after reuses the new pin",
                xy=(5.5, 1.9), xytext=(7.85, 0.25), fontsize=8, color="#b22", ha="left",
                va="bottom")
    fig.tight_layout()
    OUT.parent.mkdir(exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()

"""The run's PNG figures: headless matplotlib (Agg: no display needed), written atomically."""
from __future__ import annotations

from pathlib import Path

from trace_rl.core.io import atomic_write


def subplots(*args, **kw):
    """(figure, axes) as `plt.subplots`, on the Agg backend whatever the environment sets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kw)


def save_figure(fig, path: str | Path, dpi: int = 120) -> None:
    """Lay out, write the PNG atomically (temp file, then rename) and close the figure."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))
    finally:
        plt.close(fig)

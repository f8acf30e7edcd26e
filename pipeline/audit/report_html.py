"""The building blocks of `pipeline report`'s page: a matplotlib figure as an embedded PNG, a table, a section.

matplotlib is imported when a figure is drawn, never at import (`import pipeline` does not need it).
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any


def png(figure: Any) -> str:
    """The figure as a `data:` URI (PNG, base64), closed after drawing: the page fetches nothing."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def new_figure(columns: int = 1) -> tuple[Any, Any]:
    """A figure of `columns` plots side by side, drawn off-screen (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=(4.0 + 2.0 * columns, 3.2))


def html_table(header: list[str], rows: list[list[Any]]) -> str:
    """A table; floats to 4 significant digits, NaN as "—"."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "—" if math.isnan(value) else f"{value:.4g}"
        return html.escape(str(value))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_section(title: str, image: str | None, table: str, note: str = "") -> str:
    """A titled section: the plot (a `png` URI, or none) beside its table, under an optional note."""
    img = f'<img alt="{html.escape(title)}" src="{image}">' if image else ""
    note_html = f"<p class='note'>{html.escape(note)}</p>" if note else ""
    return (f"<section><h2>{html.escape(title)}</h2>{note_html}<div class='pair'><div>{img}</div>"
            f"<div>{table}</div></div></section>")

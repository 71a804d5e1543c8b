"""The HTML pieces every page of the harness is made of: one inline style sheet, escaped text,
tables, and matplotlib figures embedded as base64 PNGs, so a page loads with no network
(the nightly report and ``--compare``'s page)."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable
from string import Template
from typing import Any

from matplotlib.figure import Figure

PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title</title>
<style>
  body { font-family: sans-serif; margin: 1.5em auto; max-width: 1250px; color: #222; padding: 0 1em; }
  h1 { font-size: 1.5em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
  table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.88em; }
  th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
  th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .pass, .ok { color: #176317; } .regressed, .failed { color: #b00020; font-weight: bold; } .none { color: #666; }
  ul.findings li { color: #b00020; margin: 0.2em 0; }
  .plots { display: flex; flex-wrap: wrap; gap: 1em; } .plots figure { margin: 0; }
  .plots figcaption { font-size: 0.85em; color: #555; } img.plot { width: 560px; height: auto; border: 1px solid #ddd; }
  pre { background: #f7f7f7; padding: 0.5em; overflow-x: auto; font-size: 0.8em; } .meta { color: #555; }
</style>
</head>
<body>
$body
</body>
</html>
""")


def e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def table(header: Iterable[str], rows: Iterable[Iterable[str]], numeric: frozenset[int] | set[int] = frozenset()) -> str:
    """Cells are HTML already (callers escape text)."""
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r)) + "</tr>" for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)


def png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def img(fig: Figure, alt: str, caption: str) -> str:
    return f'<figure><img class="plot" alt="{e(alt)}" src="data:image/png;base64,{png(fig)}"><figcaption>{e(caption)}</figcaption></figure>'

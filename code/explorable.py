"""Explorable figures: a chart with a control the reader moves, with or without a kernel.

A figure in the book is computed once, when the chapter runs. An explorable figure computes
every state its control can reach at that time (with the book's own functions) and hands the
table to an Altair chart whose parameters are bound to native form controls: a slider, a
drop-down, a check box. Moving the control filters the table in the reader's browser; no
Python runs there.

``explorable(chart, name, alt)`` shows such a chart:

- In the HTML book (the build sets ``ATTENTION_BOOK_HTML``): an HTML block, a ``<div>`` of
  class ``explorable`` with the stable id ``explorable-<name>``, holding the chart's
  Vega-Lite specification as JSON and an image of its first state with ``alt`` as its text.
  The site's ``_static/explorable.js`` draws the live chart there with the Vega libraries
  that the build ships in ``_static/vega/`` (no network), in the page's light or dark
  theme. The image is what a reader without JavaScript sees and what the page prints.
- Anywhere else (Jupyter, Colab): the chart itself, which Altair renders interactively.

Altair and vl-convert-python are imported only when a figure is shown, so the rest of the
book's code runs without them.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re

__all__ = ["explorable", "BOOK_HTML"]

BOOK_HTML = "ATTENTION_BOOK_HTML"  # set by _ext/explorables.py for the book's build
_NAME = re.compile(r"[a-z][a-z0-9-]*")


def _bound_params(spec: dict) -> list[str]:
    """Names of the parameters bound to an input, at the top level or in sub-charts."""
    found = []
    if isinstance(spec, dict):
        for param in spec.get("params", []):
            if "bind" in param:
                found.append(param["name"])
        for key in ("layer", "hconcat", "vconcat", "concat"):
            for sub in spec.get(key, []):
                found += _bound_params(sub)
    return found


class _HTMLFigure:
    """What a notebook front end displays: the block as HTML, a line as plain text."""

    def __init__(self, html_text: str, name: str):
        self.html_text, self.name = html_text, name

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/html": self.html_text,
                "text/plain": f"<explorable figure {self.name}>"}


def explorable(chart, name: str, alt: str):
    """Show ``chart`` as the explorable figure ``name``, described by ``alt``.

    ``chart`` must have at least one parameter bound to a control (``alt.param(bind=...)``);
    ``name`` is lower case letters, digits and hyphens, unique in the book; ``alt`` says what
    the first state shows, for readers who cannot see it.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"name must be lower-case letters, digits and '-', got {name!r}")
    if not isinstance(alt, str) or not alt.strip():
        raise ValueError(f"explorable {name!r}: give alt text describing the figure")
    chart = chart.properties(description=alt)  # vega-embed makes it the chart's aria-label
    spec = chart.to_dict()
    if not _bound_params(spec):
        raise ValueError(f"explorable {name!r}: the chart has no parameter bound to a control")
    if not os.environ.get(BOOK_HTML):
        return chart
    import vl_convert

    svg = vl_convert.vegalite_to_svg(spec)
    image = base64.b64encode(svg.encode()).decode()
    # Inside <script>, only "</" could end the element early; JSON allows "<\/" for it.
    spec_json = json.dumps(spec, sort_keys=True, separators=(",", ":")).replace("</", "<\\/")
    block = (
        f'<div class="explorable" id="explorable-{name}">'
        f'<script type="application/json" class="explorable-spec">{spec_json}</script>'
        f'<img class="explorable-still" alt="{html.escape(alt)}" '
        f'src="data:image/svg+xml;base64,{image}">'
        "</div>")
    return _HTMLFigure(block, name)

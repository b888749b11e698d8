"""Explorable figures in the HTML book, with the Vega libraries shipped in the site.

A chapter shows an explorable figure with ``code/explorable.py``'s ``explorable()``, which
writes an HTML block (class ``explorable``) holding the chart's Vega-Lite specification and a
still image. Three things here make those blocks live, offline:

* ``ATTENTION_BOOK_HTML`` is set in this process's environment when the extension loads, so
  the kernels that myst-nb starts for the chapters inherit it and ``explorable()`` writes the
  block (outside the book it returns the Altair chart for Jupyter to render).
* The JavaScript of Vega, Vega-Lite and vega-embed, bundled into one file by the pinned
  vl-convert-python (``javascript_bundle``), is written to ``_static/vega/vega-bundle.js``
  once per build. The pages that have an explorable figure, and only those, name it in a
  ``<meta name="explorable-bundle">`` tag, from which ``_static/explorable.js`` loads it when
  a figure first comes near the screen (297 KB gzip: a reader who never reaches a figure does
  not load it). Its Vega-Lite version is the one the pinned Altair writes specifications for.
* ``_static/explorable.js`` (on every page, as Jupyter Book adds everything in ``_static``)
  draws each block with vega-embed once the bundle has loaded, in the page's theme.

Registered in _config.yml under ``sphinx: local_extensions``.
"""

from __future__ import annotations

import os
import pathlib
import sys

from sphinx.application import Sphinx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "code"))
from explorable import BOOK_HTML  # noqa: E402

BUNDLE = "vega/vega-bundle.js"  # inside the output's _static/


def vegalite_version() -> str:
    """The Vega-Lite version, major.minor, that the pinned Altair writes specifications for."""
    import altair

    return ".".join(altair.VEGALITE_VERSION.split(".")[:2])


def bundle_text() -> str:
    import vl_convert

    header = (f"/* Vega {vl_convert.get_vega_version()}, Vega-Lite {vegalite_version()}, "
              f"vega-embed {vl_convert.get_vega_embed_version()}: bundled by vl-convert-python "
              "for the explorable figures (_ext/explorables.py). */\n")
    # The bundle declares top-level constants (one named `_`) that would clash with the page's
    # other scripts (Sphinx's doctools.js declares `_` too): a function scope keeps them apart,
    # and the bundle's last lines still set window.vega, window.vegaLite and window.vegaEmbed.
    return (header + "(() => {\n" + vl_convert.javascript_bundle(vl_version=vegalite_version())
            + "\n})();\n")


def add_bundle(app: Sphinx, pagename, templatename, context, doctree) -> None:
    """Name the Vega bundle on the pages that have an explorable figure."""
    if 'class="explorable"' in context.get("body", ""):
        address = context["pathto"](f"_static/{BUNDLE}", 1)
        context["metatags"] = (context.get("metatags", "")
                               + f'\n<meta name="explorable-bundle" content="{address}" />')


def write_bundle(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    target = pathlib.Path(app.outdir) / "_static" / BUNDLE
    text = bundle_text()
    if not target.is_file() or target.read_text() != text:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def setup(app: Sphinx) -> dict:
    os.environ[BOOK_HTML] = "1"
    app.connect("html-page-context", add_bundle)
    app.connect("build-finished", write_bundle)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}

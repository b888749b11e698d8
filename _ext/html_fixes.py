"""Four fixes to the HTML that Sphinx 7.4, docutils 0.21 and the theme write, found by
tests/test_site.py.

* Inline scripts twice. ``app.add_js_file(None, body=...)`` called after the builder started
  (sphinx-togglebutton and sphinx-thebe do) reaches the page twice, once as ``None`` and once
  as ``''`` (fixed upstream in Sphinx 8.2, sphinx-doc/sphinx#13402; Jupyter Book 1 needs
  Sphinx 7). sphinx-thebe's script declares ``const THEBE_JS_URL``, so the second copy is an
  uncaught SyntaxError on every page. Each page's script list is deduplicated here.
* Bibliography roles. docutils marks each citation ``role="doc-biblioentry"`` inside a
  ``role="list"`` element; DPUB-ARIA 1.1 deprecates that role, so assistive technology (and
  axe-core, as a critical violation) sees a list without list items. Each citation is given
  ``role="listitem"``, as DPUB-ARIA 1.1 advises.
* Font Awesome twice. pydata-sphinx-theme 0.15 puts ``scripts/fontawesome.js`` in every page's
  head ("so that users can add custom icons"): Font Awesome's JavaScript with every icon, 1.5 MB,
  542 KB gzip, more than everything else a chapter page loads. It turns each ``<i class="fa-...">``
  into an inline SVG. The theme's own stylesheet already holds Font Awesome's CSS and its
  fonts, which draw the same icons from the same ``<i>`` elements, so the script only repeats
  them. Once the build has written the pages, the script's tag is taken out of each, and the
  script out of ``_static/``. tests/test_site.py checks that no page loads it and that every
  icon on a page still draws its glyph; when the theme stops adding the script, the tag is not
  found and nothing is removed (``FONTAWESOME_TAG``).
* The search index on every page. The theme loads Sphinx's ``searchindex.js`` (42 KB gzip),
  ``searchtools.js`` and ``language_data.js`` into every page for its search-as-you-type,
  which the book leaves off (``search_as_you_type`` false: the search field opens the search
  page, which loads them itself). They are taken out of every page but the search page.

Registered in _config.yml under ``sphinx: local_extensions``.
"""

from __future__ import annotations

import pathlib
import re

from sphinx.application import Sphinx
from sphinx.writers.html5 import HTML5Translator


def drop_duplicate_scripts(app: Sphinx, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        key = (script.filename or "", script.priority, tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique  # the builder's own list, restored after each page


class CitationListItemTranslator(HTML5Translator):
    """Sphinx's HTML5 translator, with citations as list items (pydata-sphinx-theme mixes its
    Bootstrap additions into whatever translator is registered)."""

    def visit_citation(self, node) -> None:
        super().visit_citation(node)
        self.body[-1] = self.body[-1].replace('role="doc-biblioentry"', 'role="listitem"', 1)


FONTAWESOME = "_static/scripts/fontawesome.js"
FONTAWESOME_TAG = re.compile(r'[ \t]*<script defer src="[^"]*_static/scripts/fontawesome\.js'
                             r'(\?[^"]*)?"></script>\n?')


SEARCH_TAGS = re.compile(r'[ \t]*<script src="[^"]*(_static/searchtools\.js|'
                         r'_static/language_data\.js|searchindex\.js)"></script>\n?')


def drop_unused_scripts(app: Sphinx, exception) -> None:
    """Take the theme's fontawesome.js out of every written page, and out of _static/; and,
    without search-as-you-type, the search scripts out of every page but the search page."""
    if exception is not None or app.builder.format != "html":
        return
    out = pathlib.Path(app.outdir)
    as_you_type = app.config.html_theme_options.get("search_as_you_type", False)
    for page in out.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        trimmed = FONTAWESOME_TAG.sub("", text)
        if not as_you_type and page != out / "search.html":
            trimmed = SEARCH_TAGS.sub("", trimmed)
        if trimmed != text:
            page.write_text(trimmed, encoding="utf-8")
    for path in (out / FONTAWESOME, out / f"{FONTAWESOME}.map"):
        path.unlink(missing_ok=True)


def setup(app: Sphinx) -> dict:
    app.connect("html-page-context", drop_duplicate_scripts, priority=900)
    app.connect("build-finished", drop_unused_scripts)
    app.set_translator("html", CitationListItemTranslator)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}

"""Two fixes to the HTML that Sphinx 7.4 and docutils 0.21 write, found by tests/test_site.py.

* Inline scripts twice. ``app.add_js_file(None, body=...)`` called after the builder started
  (sphinx-togglebutton and sphinx-thebe do) reaches the page twice, once as ``None`` and once
  as ``''`` (fixed upstream in Sphinx 8.2, sphinx-doc/sphinx#13402; Jupyter Book 1 needs
  Sphinx 7). sphinx-thebe's script declares ``const THEBE_JS_URL``, so the second copy is an
  uncaught SyntaxError on every page. Each page's script list is deduplicated here.
* Bibliography roles. docutils marks each citation ``role="doc-biblioentry"`` inside a
  ``role="list"`` element; DPUB-ARIA 1.1 deprecates that role, so assistive technology (and
  axe-core, as a critical violation) sees a list without list items. Each citation is given
  ``role="listitem"``, as DPUB-ARIA 1.1 advises.

Registered in _config.yml under ``sphinx: local_extensions``.
"""

from __future__ import annotations

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


def setup(app: Sphinx) -> dict:
    app.connect("html-page-context", drop_duplicate_scripts, priority=900)
    app.set_translator("html", CitationListItemTranslator)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}

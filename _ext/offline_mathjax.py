"""Ship MathJax with the book instead of loading it from a CDN.

Readers in a classroom may have a slow network or none at all, so the HTML output carries its
own copy of MathJax 3.2.2, taken from the pinned PyPI package django-static-mathjax
(requirements.txt). Only the files that the pages load are copied into ``_static/mathjax/``,
in MathJax's own ``es5/`` layout, since MathJax finds its fonts and extensions relative to
the script it was loaded from:

* ``tex-mml-chtml.js``: the combined component Sphinx uses by default (TeX and MathML input,
  CommonHTML output, the context menu, assistive MathML for screen readers);
* ``input/tex/extensions/``: TeX packages that ``autoload`` fetches when a page first uses one
  of their macros (``\\boldsymbol``, ``\\cancel``, ...);
* ``output/chtml/fonts/woff-v2/``: the CommonHTML fonts.

Left out (about 20 MB): the other combined components, SVG output, and the speech-rule engine
that only the context menu's optional explorer loads. The MathJax configuration is also set
here (see use_local_mathjax): unknown TeX macros are errors the browser tests catch, and
formulas are not Tab stops.

Registered in _config.yml under ``sphinx: local_extensions``.
"""

from __future__ import annotations

import pathlib

import mathjax  # the django-static-mathjax package
from sphinx.application import Sphinx
from sphinx.util.osutil import copyfile, ensuredir

SOURCE = pathlib.Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
TARGET = "mathjax"  # inside the output's _static/
ENTRY = "tex-mml-chtml.js"
FOLDERS = ("input/tex/extensions", "output/chtml/fonts/woff-v2")


def files_to_copy() -> list[pathlib.Path]:
    """The MathJax files the site needs, relative to es5/."""
    files = [pathlib.Path(ENTRY)]
    for folder in FOLDERS:
        files += sorted(p.relative_to(SOURCE) for p in (SOURCE / folder).rglob("*") if p.is_file())
    return files


def use_local_mathjax(app: Sphinx, config) -> None:
    # A path without a scheme is relative to _static/; Sphinx writes the right relative URL
    # into every page, so the site also works opened from disk.
    config.mathjax_path = f"{TARGET}/{ENTRY}"
    mj = dict(config.mathjax3_config or {})
    # Without the `noundefined` package an unknown macro is a visible MathJax error (an
    # mjx-merror element, which tests/test_site.py looks for) rather than quietly red text.
    mj.setdefault("tex", {}).setdefault("packages", {"[-]": ["noundefined"]})
    # MathJax puts every formula in the Tab order (for its context menu), a few hundred stops
    # per chapter before a keyboard reader reaches the next link or solution. Screen readers
    # read the formulas from MathJax's assistive MathML without focus, and a reader who wants
    # them focusable can turn "Include in Tab Order" back on in MathJax's menu.
    mj.setdefault("options", {}).setdefault("menuOptions", {}).setdefault(
        "settings", {}).setdefault("inTabOrder", False)
    config.mathjax3_config = mj


def copy_mathjax(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    target = pathlib.Path(app.outdir) / "_static" / TARGET
    for rel in files_to_copy():
        ensuredir(target / rel.parent)
        copyfile(SOURCE / rel, target / rel)  # a no-op when the copy is already identical


def setup(app: Sphinx) -> dict:
    if not (SOURCE / ENTRY).is_file():
        raise RuntimeError(f"MathJax not found at {SOURCE}: install requirements.txt")
    # After sphinx.ext.mathjax has registered mathjax_path with its CDN default.
    app.connect("config-inited", use_local_mathjax, priority=900)
    app.connect("build-finished", copy_mathjax)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}

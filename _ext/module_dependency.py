"""Make every executed chapter depend on the book's code: code/attention.py and code/checks.py.

Chapters execute on every read (``execute_notebooks: force``), so a clean build can never
show stale output. An incremental build re-reads only the pages whose source changed, and a
chapter's source does not change when the module it imports does. Recording the module as a
dependency of every notebook page makes Sphinx re-read, and so re-execute, all of them when
``code/attention.py`` changes, while a rebuild with nothing changed stays a no-op.

Registered in _config.yml under ``sphinx: local_extensions``.
"""

from __future__ import annotations

import pathlib

from sphinx.application import Sphinx

MODULES = [pathlib.Path("code") / name for name in ("attention.py", "checks.py")]


def note_module_dependency(app: Sphinx, docname: str, source: list[str]) -> None:
    """On reading a page that has code cells, record that it depends on the module."""
    if "```{code-cell}" in source[0]:
        for module in MODULES:
            app.env.note_dependency(str(pathlib.Path(app.srcdir) / module))


def setup(app: Sphinx) -> dict:
    app.connect("source-read", note_module_dependency)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

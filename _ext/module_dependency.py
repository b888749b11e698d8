"""Make every executed chapter depend on the book's code: every file of code/.

Chapters execute on every read (``execute_notebooks: force``), so a clean build can never
show stale output. An incremental build re-reads only the pages whose source changed, and a
chapter's source does not change when the module it imports does. Recording the module as a
dependency of every notebook page makes Sphinx re-read, and so re-execute, all of them when
a file of ``code/`` changes, while a rebuild with nothing changed stays a no-op.

Registered in _config.yml under ``sphinx: local_extensions``.
"""

from __future__ import annotations

import pathlib

from sphinx.application import Sphinx

def note_module_dependency(app: Sphinx, docname: str, source: list[str]) -> None:
    """On reading a page that has code cells, record that it depends on the book's code."""
    if "```{code-cell}" in source[0]:
        for module in sorted((pathlib.Path(app.srcdir) / "code").glob("*.py")):
            app.env.note_dependency(str(module))


def setup(app: Sphinx) -> dict:
    app.connect("source-read", note_module_dependency)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

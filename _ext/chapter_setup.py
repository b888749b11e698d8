"""The setup cell of every chapter, inserted as Sphinx reads the chapter.

No chapter source contains the setup cell that makes the book's code importable: its one
template is in tools/chapter_structure.py, which the notebook writer (notebooks.py) also uses
for the Colab and Binder notebooks. Here the cell is put in front of each numbered chapter as
Sphinx reads it, so myst-nb executes it first (`chapter_structure.with_setup_cell`, which keeps
every line of the source at its number, so warnings point at the source's lines). The cell
loads its code from a file in the doctree folder, one per chapter: a chapter's setup cell makes
importable the book's modules and the checks its exercises import (`code_files`).

Registered in _config.yml under ``sphinx: local_extensions``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sphinx.application import Sphinx

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import chapter_structure as structure  # noqa: E402


def setup_file(app: Sphinx, docname: str) -> Path:
    return Path(app.doctreedir) / "setup-cells" / f"{Path(docname).name}.py"


def write_setup_file(app: Sphinx, docname: str, text: str) -> Path:
    path, code = setup_file(app, docname), structure.setup_source(structure.code_files(text))
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text() != code:
        path.write_text(code)
    return path


def insert_setup_cell(app: Sphinx, docname: str, source: list[str]) -> None:
    if not structure.CHAPTER_DOC.match(docname):
        return
    path = write_setup_file(app, docname, source[0])
    source[0] = structure.with_setup_cell(source[0], str(path))
    # What the setup code is made from: a change re-reads (and re-executes) the chapter.
    for path in (TOOLS / "chapter_structure.py", Path(app.srcdir) / "_config.yml",
                 Path(app.srcdir) / "requirements.txt"):
        app.env.note_dependency(str(path))


def setup(app: Sphinx) -> dict:
    app.connect("source-read", insert_setup_cell)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

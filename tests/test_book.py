"""The whole book builds strictly, with every cell of every chapter executed.

One build (the `build` fixture in conftest.py, the same command as `make book`) serves every
test here.
"""

from __future__ import annotations

import json
import pathlib
import re

import nbformat
import pytest

import classroom
from conftest import READ_DONE, toc_docs

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.book


def test_build_succeeds_without_warnings(build):
    returncode, log, _ = build
    # The kernel's own start-up notice on stderr is not a Sphinx warning; everything else is.
    warnings = [line for line in log.splitlines()
                if re.search(r"WARNING|ERROR", line) and not line.startswith("[IPKernelApp]")]
    assert returncode == 0, "book build failed:\n" + "\n".join(warnings[-40:] or log.splitlines()[-40:])
    assert warnings == []
    assert "build succeeded" in log


def test_the_build_log_says_when_every_chapter_has_executed(build):
    """conftest.build starts the notebooks alone when the build's log shows READ_DONE: Sphinx
    logs it once, after the last page is read (so every chapter executed) and before it writes."""
    _, log, _ = build
    if not log:
        pytest.skip("BOOK_REUSE_BUILD: no log")
    executed = [m.end() for m in re.finditer(r"Executed notebook in", log)]
    assert log.count(READ_DONE) == 1 and executed, log[-2000:]
    assert max(executed) < log.index(READ_DONE) < log.rindex("writing output")


def test_every_page_in_the_toc_is_built(build):
    _, _, out = build
    for doc in toc_docs():
        assert (out / "html" / f"{doc}.html").is_file(), doc


def executed_notebooks(out: pathlib.Path) -> dict[str, dict]:
    return {
        str(p.relative_to(out / "jupyter_execute").with_suffix("")): json.loads(p.read_text())
        for p in (out / "jupyter_execute").rglob("*.ipynb")
    }


def test_every_code_cell_was_executed(build):
    _, _, out = build
    notebooks = executed_notebooks(out)
    chapters = [doc for doc in toc_docs() if (ROOT / f"{doc}.md").read_text().startswith("---\njupytext")]
    assert sorted(notebooks) == sorted(chapters)
    for name, nb in notebooks.items():
        code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert code_cells, name
        for cell in code_cells:
            assert isinstance(cell.get("execution_count"), int), f"{name}: unexecuted cell {cell['source'][:80]!r}"
            may_raise = "raises-exception" in cell.get("metadata", {}).get("tags", [])
            for output in cell.get("outputs", []):
                assert may_raise or output["output_type"] != "error", f"{name}: {output.get('ename')}"
                assert output.get("name") != "stderr", f"{name}: stderr {output.get('text')!r}"


def test_every_cell_that_claims_an_error_shows_it(build):
    """A cell tagged raises-exception names its exception in its first line, `# raises Name`,
    and its output holds that exception; no other cell shows an error."""
    _, _, out = build
    tagged = 0
    for name, nb in executed_notebooks(out).items():
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            errors = [o for o in cell.get("outputs", []) if o["output_type"] == "error"]
            source = "".join(cell["source"])
            if "raises-exception" in cell.get("metadata", {}).get("tags", []):
                tagged += 1
                claim = re.match(r"# raises (\w+)", source)
                assert claim, f"{name}: a raises-exception cell must start with '# raises Name'"
                assert [e["ename"] for e in errors] == [claim.group(1)], (
                    f"{name}: the cell says it raises {claim.group(1)}, its output shows "
                    f"{[e['ename'] for e in errors] or 'no error'}:\n{source[:300]}")
            else:
                assert not errors, f"{name}: untagged cell raised {errors[0]['ename']}"
    assert tagged, "no cell demonstrates an error: is the tag still used?"


def test_figures_are_reproducible_svg(build):
    _, _, out = build
    svgs = list((out / "html" / "_images").glob("*.svg"))
    chapters = [doc for doc in toc_docs() if doc.split("/")[-1][:2].isdigit()]
    if chapters:
        assert svgs, "chapters exist but no SVG figure was written"
    for svg in svgs:
        text = svg.read_text()
        assert "<dc:date>" not in text, f"{svg.name} carries a date stamp"


def test_committed_notebooks_are_the_builds(build):
    """chapters/*.ipynb, which Colab and Binder open, are what this build writes."""
    _, _, out = build
    built = sorted((out / "notebooks" / "chapters").glob("*.ipynb"))
    committed = classroom.chapter_notebooks()
    assert [p.name for p in built] == [p.name for p in committed]
    stale = [theirs.name for mine, theirs in zip(built, committed)
             if mine.read_text() != theirs.read_text()]
    assert not stale, f"stale: {', '.join(stale)}: run `make notebooks` and commit them"


def test_launch_and_download_buttons_give_the_notebooks(build):
    _, _, out = build
    repo = classroom.repository()
    where, ref = f"{repo['org']}/{repo['repo']}", repo["ref"]
    for path in classroom.chapter_notebooks():
        name = path.stem
        html = (out / "html" / "chapters" / f"{name}.html").read_text()
        assert (f'href="https://colab.research.google.com/github/{where}/blob/{ref}/'
                f'chapters/{name}.ipynb"') in html
        assert (f'href="https://mybinder.org/v2/gh/{where}/{ref}?urlpath=lab/tree/'
                f'chapters/{name}.ipynb"') in html
        assert f'href="../_sources/chapters/{name}.ipynb"' in html
        download = nbformat.read(out / "html" / "_sources" / "chapters" / f"{name}.ipynb", 4)
        committed = nbformat.read(path, 4)
        # The same cells as the notebook that runs alone in tests/test_classroom.py, with the
        # outputs this build produced.
        assert [c.source for c in download.cells] == [c.source for c in committed.cells]
        outputs = [o for c in download.cells if c.cell_type == "code"
                   and "raises-exception" not in c.metadata.get("tags", []) for o in c.outputs]
        assert outputs and all(o.output_type != "error" for o in outputs)


def test_every_launch_button_opens_a_committed_notebook(build):
    """A Colab or Binder button opens a notebook of the repository: on a page without one
    (the appendix runs cells but has no notebook) there is no launch button at all."""
    _, _, out = build
    root = pathlib.Path(__file__).resolve().parents[1]
    found = []
    for page in (out / "html").rglob("*.html"):
        for target in re.findall(r'href="https://(?:colab\.research\.google\.com/github|mybinder'
                                 r'\.org/v2/gh)/[^"]*?(chapters/[\w-]+\.\w+)"', page.read_text()):
            found.append(target)
            assert target.endswith(".ipynb") and (root / target).is_file(), (page.name, target)
    assert found


def test_the_build_executes_the_setup_cell_first(build):
    """No source holds the setup cell (tests/test_chapters.py); the build inserts it
    (_ext/chapter_setup.py) and executes it before any cell of the chapter, and the page shows
    nothing of it."""
    import chapter_structure

    _, _, out = build
    for path in classroom.numbered_chapters():
        name = path.stem
        executed = nbformat.read(out / "jupyter_execute" / "chapters" / f"{name}.ipynb", 4)
        code = [c for c in executed.cells if c.cell_type == "code"]
        assert code[0].source == chapter_structure.setup_source(
            chapter_structure.code_files(path.read_text())), name
        assert code[0].execution_count == 1, name
        printed = "".join(o.get("text", "") for o in code[0].outputs)
        assert printed.startswith(f"torch {chapter_structure.torch_pin()}"), (name, printed)
        html = (out / "html" / "chapters" / f"{name}.html").read_text()
        assert "Setup, hidden in the book" not in html and "BOOK_TORCH" not in html, name

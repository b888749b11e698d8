"""The whole book builds strictly, with every cell of every chapter executed.

One build (the `build` fixture in conftest.py, the same command as `make book`) serves every
test here.
"""

from __future__ import annotations

import json
import pathlib
import pickle
import re

import nbformat
import pytest

import classroom
from conftest import build_book, toc_docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_CHAPTER_SECONDS = 20.0

pytestmark = pytest.mark.book


def test_build_succeeds_without_warnings(build):
    returncode, log, _ = build
    # The kernel's own start-up notice on stderr is not a Sphinx warning; everything else is.
    warnings = [line for line in log.splitlines()
                if re.search(r"WARNING|ERROR", line) and not line.startswith("[IPKernelApp]")]
    assert returncode == 0, "book build failed:\n" + "\n".join(warnings[-40:] or log.splitlines()[-40:])
    assert warnings == []
    assert "build succeeded" in log


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
            for output in cell.get("outputs", []):
                assert output["output_type"] != "error", f"{name}: {output.get('ename')}"
                assert output.get("name") != "stderr", f"{name}: stderr {output.get('text')!r}"


def test_each_chapter_executes_in_under_20_seconds(build):
    _, _, out = build
    with open(out / ".doctrees" / "environment.pickle", "rb") as f:
        env = pickle.load(f)
    runtimes = {doc: data["exec_data"]["runtime"] for doc, data in env.nb_metadata.items()
                if data.get("exec_data")}
    assert runtimes, "no execution data recorded"
    print("\n".join(f"{doc}: {t:.1f} s" for doc, t in sorted(runtimes.items())))
    slow = {doc: t for doc, t in runtimes.items() if t > MAX_CHAPTER_SECONDS}
    assert not slow, f"chapters over {MAX_CHAPTER_SECONDS} s: {slow}"


def test_figures_are_reproducible_svg(build):
    _, _, out = build
    svgs = list((out / "html" / "_images").glob("*.svg"))
    chapters = [doc for doc in toc_docs() if doc.split("/")[-1][:2].isdigit()]
    if chapters:
        assert svgs, "chapters exist but no SVG figure was written"
    for svg in svgs:
        text = svg.read_text()
        assert "<dc:date>" not in text, f"{svg.name} carries a date stamp"


def wall_clock_pages() -> set[str]:
    """Pages with cells tagged `wall-clock`: they time code, so their numbers vary by design."""
    return {f"{doc}.html" for doc in toc_docs()
            if re.search(r"tags: \[[^\]]*wall-clock", (ROOT / f"{doc}.md").read_text())}


def test_two_builds_give_identical_pages(build, tmp_path):
    """Seeded computations, salted SVG ids and no time stamps: a rebuild changes no byte,
    except on pages whose cells are tagged `wall-clock` (they measure running time), in the
    figures only those pages show, and in the search index that holds their text."""
    returncode, _, out = build
    assert returncode == 0
    again_code, again_log, again = build_book(tmp_path)
    assert again_code == 0, again_log[-2000:]

    def files(root):
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    first, second = files(out / "html"), files(again / "html")
    timed = wall_clock_pages()
    timed_text = b"".join(first[page] + second[page] for page in timed)
    other_text = b"".join(data for name, data in {**first, **second}.items()
                          if name.endswith(".html") and name not in timed)
    changed = {name for name in first.keys() | second.keys() if first.get(name) != second.get(name)}
    allowed = set(timed) | ({"searchindex.js"} if timed else set())
    # and the download notebook of such a page, which carries its outputs
    allowed |= {f"_sources/{page.removesuffix('.html')}.ipynb" for page in timed}
    for name in changed - allowed:
        image = pathlib.PurePosixPath(name)
        # A timing figure: shown on a wall-clock page and on no other page.
        assert (image.parent.name == "_images" and image.name.encode() in timed_text
                and image.name.encode() not in other_text), f"{name} changed between two builds"


def test_committed_notebooks_are_the_builds(build):
    """chapters/*.ipynb, which Colab and Binder open, are what this build writes."""
    _, _, out = build
    built = sorted((out / "notebooks" / "chapters").glob("*.ipynb"))
    committed = classroom.chapter_notebooks()
    assert [p.name for p in built] == [p.name for p in committed]
    for mine, theirs in zip(built, committed):
        assert mine.read_text() == theirs.read_text(), (
            f"chapters/{theirs.name} is stale: run `make notebooks` and commit it")


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
        outputs = [o for c in download.cells if c.cell_type == "code" for o in c.outputs]
        assert outputs and all(o.output_type != "error" for o in outputs)

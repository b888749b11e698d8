"""Static checks of the chapter sources: the conventions every chapter promises its readers."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import chapter_structure
from classroom import numbered_chapters
from conftest import toc_docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"


def test_toc_and_chapter_folder_agree():
    docs = toc_docs()
    for doc in docs:
        assert (ROOT / f"{doc}.md").is_file(), f"_toc.yml lists {doc}, which does not exist"
    on_disk = {f"chapters/{p.stem}" for p in CHAPTERS.glob("*.md")}
    assert on_disk == set(docs), f"pages not in the toc: {on_disk - set(docs)}"


def test_no_formula_sets_a_colour():
    """The site's contrast audit leaves MathJax's elements to the paragraphs around them
    (tests/test_site.py, AXE_RUN_JS): that holds while no formula colours its text."""
    for page in sorted(CHAPTERS.glob("*.md")):
        assert not re.search(r"\\(?:color|textcolor|colorbox)\b", page.read_text()), page.name


def test_chapters_are_in_book_order():
    numbered = [d for d in toc_docs() if re.match(r"chapters/\d\d-", d)]
    assert numbered == sorted(numbered)


def test_bibliography_keys_exist():
    keys = set(re.findall(r"^@\w+\{([^,]+),", (ROOT / "references.bib").read_text(), re.M))
    for page in CHAPTERS.glob("*.md"):
        for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", page.read_text()):
            for key in group.split(","):
                assert key.strip() in keys, f"{page.name}: unknown citation {key!r}"


@pytest.mark.parametrize("path", numbered_chapters(), ids=lambda p: p.stem)
class TestChapter:
    def test_source_has_no_setup_cell(self, path):
        """The setup cell is inserted by the build and the notebook writer, from
        tools/chapter_structure.py's one template; a source holds none of it."""
        text = path.read_text()
        for line in chapter_structure.setup_source().splitlines()[:7]:
            assert line not in text, f"{path.name} holds a line of the setup cell: {line!r}"
        assert not any(chapter_structure.SETUP in cell.tags
                       for cell in chapter_structure.read_source(path).cells)

    def test_imports_the_module_and_defines_no_copy(self, path):
        text = path.read_text()
        assert "from attention import" in text
        for name in ("scaled_dot_product_attention", "causal_mask", "padding_mask",
                     "MultiHeadAttention", "KVCache", "repeat_kv", "plot_attention",
                     "sinusoidal_encoding", "rotary_embedding", "alibi_bias", "flash_attention"):
            assert not re.search(rf"^\s*(def|class) {name}\b", text, re.M), (
                f"{path.name} defines its own {name}; import it from code/attention.py"
            )

    def test_has_the_parts_of_a_chapter(self, path):
        text = path.read_text()
        assert re.search(r"^\(ch-[a-z]+\)=\n# ", text, re.M), "label and title"
        for heading in ("## Summary", "## Exercises"):
            assert heading in text, heading
        assert "vaswani2017attention" in text

    def test_has_captioned_figures_with_alt_text(self, path):
        text = path.read_text()
        # The metadata of a figure cell, and the code after it up to the cell's end.
        figures = re.findall(r"mystnb:\n\s+figure:\n(?:.*\n)*?---\n(?:.*\n)*?```", text)
        assert len(figures) >= 2, "at least two figures"
        for block in figures:
            # An explorable figure's alt text is explorable()'s argument (tests/test_explorable.py
            # and the site tests check it); an image's is the cell's `image: alt:`.
            assert "caption:" in block and ("alt:" in block or "\nexplorable(" in block), block[:200]

    def test_has_exercises_with_solutions(self, path):
        source = chapter_structure.read_source(path)
        assert len(source.exercises) >= 3
        for exercise in source.exercises:
            assert exercise.solution is not None, f"{exercise.label} has no solution"
            assert exercise.solution.get("class") == "dropdown", (
                f"{exercise.label} has no collapsed solution")
        assert any(cell.solution_of and chapter_structure.check_calls(cell.source)
                   for cell in source.cells), (
            "no solution with code: at least one coding exercise must check itself")

    def test_every_figure_checks_what_its_caption_and_alt_text_say(self, path):
        """Alt text and captions are prose: what they state about the data is asserted by the
        cell that draws the figure, and a decimal number in them is an input of that cell
        (typed in its code), never a typed result that another machine could print otherwise."""
        problems = []
        for cell, name, text in figure_cells(path):
            tree = ast.parse(cell.source)
            asserts = [node for node in ast.walk(tree) if isinstance(node, ast.Assert)
                       or isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                           node.func, "id", "")).startswith("assert_")]
            if not asserts:
                problems.append(f"{name}: the cell asserts nothing of what its description says")
            typed = [number for number in DECIMAL.findall(text) if number not in cell.source]
            if typed:
                problems.append(f"{name}: {typed} in its caption or alt text are not in its code")
        assert not problems, "\n".join(problems)

    def test_sentences_about_speed_come_from_the_run_or_a_source(self, path):
        """A sentence that compares or states running times is glued from the run it describes,
        cites the source that measured it, or tells readers what to look for in their own run:
        timings differ from machine to machine."""
        unsupported = [sentence for sentence in prose_sentences(path)
                       if timing_claim(sentence) and not SUPPORTED_TIMING.search(sentence)]
        assert not unsupported, "timing sentences with nothing behind them:\n" + "\n".join(
            unsupported)

    def test_timing_cells_are_tagged_wall_clock(self, path):
        # A cell that measures running time gives different numbers on every build; the tag
        # tells the determinism test (tests/test_book.py) that this page may change.
        text = path.read_text()
        if re.search(r"perf_counter|time\.time\(|timeit", text):
            assert re.search(r"tags: \[[^\]]*wall-clock", text), "timing cell without a wall-clock tag"


@pytest.mark.parametrize("name", ["intro", "notation", "instructors"])
def test_the_other_pages_state_no_timing_with_nothing_behind_it(name):
    unsupported = [sentence for sentence in prose_sentences(CHAPTERS / f"{name}.md")
                   if timing_claim(sentence) and not SUPPORTED_TIMING.search(sentence)]
    assert not unsupported, "\n".join(unsupported)
    seconds = re.findall(r"[^.]*\b\d+(?:\.\d+)? ?(?:s|seconds|minutes|min)\b[^.]*\.",
                         (CHAPTERS / f"{name}.md").read_text(encoding="utf-8"))
    assert not seconds, f"typed durations, which differ from machine to machine: {seconds}"


@pytest.mark.parametrize("path", numbered_chapters(), ids=lambda p: p.stem)
def test_build_inserts_the_setup_cell_first_and_keeps_every_line_number(path, tmp_path):
    """What Sphinx reads (_ext/chapter_setup.py): myst-nb finds the setup cell first, with the
    template's code, and every other cell at the source line it starts on in the file, so a
    warning's line number is the file's."""
    from myst_nb.core.read import read_myst_markdown_notebook

    text = path.read_text()
    setup_code = chapter_structure.setup_source(chapter_structure.code_files(text))
    setup_file = tmp_path / "setup-cell.py"
    setup_file.write_text(setup_code)
    read = chapter_structure.with_setup_cell(text, str(setup_file))
    front = text.split("\n").index("---", 1)
    assert read.split("\n")[front + 1:] == text.split("\n")[front + 1:]
    original = read_myst_markdown_notebook(text, add_source_map=True)
    built = read_myst_markdown_notebook(read, add_source_map=True, path=str(path))
    setup, *cells = built.cells
    assert setup.cell_type == "code" and setup.source == setup_code
    assert setup.metadata["tags"] == ["remove-cell", chapter_structure.SETUP]
    assert built.metadata["kernelspec"] == original.metadata["kernelspec"]
    assert [c.source for c in cells] == [c.source for c in original.cells]
    assert built.metadata["source_map"][1:] == original.metadata["source_map"]
    first_code = next(i for i, c in enumerate(original.cells) if c.cell_type == "code")
    line = original.metadata["source_map"][first_code]  # the line after its opening fence
    assert text.split("\n")[line - 1].startswith("```{code-cell}")


def test_chapter_notebook_has_the_setup_cell_after_the_title():
    """What the notebook writer starts from: title, setup cell, then the chapter."""
    import jupytext

    for path in numbered_chapters():
        notebook = chapter_structure.chapter_notebook(path)
        title, setup, after = notebook.cells[:3]
        assert re.fullmatch(r"\(ch-[a-z-]+\)=\n# .+", title.source), title.source
        assert chapter_structure.is_setup(setup)
        assert setup.source == chapter_structure.setup_source(
            chapter_structure.code_files(path.read_text()))
        source = jupytext.read(path).cells
        assert [c.source for c in notebook.cells[3:]] == [c.source for c in source[1:]]
        assert title.source + "\n\n" + after.source == source[0].source


def test_a_warning_names_the_source_line(tmp_path):
    """A broken reference in a chapter, built by Sphinx with myst-nb and _ext/chapter_setup.py
    (execution off, so it takes seconds): the warning gives the line it has in the file."""
    import subprocess
    import sys

    src = tmp_path / "src"
    (src / "chapters").mkdir(parents=True)
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / '_ext')!r})\n"
        "extensions = ['myst_nb', 'chapter_setup']\n"
        "nb_execution_mode = 'off'\nroot_doc = 'chapters/01-lines'\n")
    front = numbered_chapters()[0].read_text().split("\n")
    front = front[:front.index("---", 1) + 1]
    lines = front + ["", "(ch-lines)=", "# Lines", "", "```{code-cell} ipython3", "x = 1", "```",
                     "", "A broken reference: {ref}`no-such-label`."]
    (src / "chapters" / "01-lines.md").write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-n", "-q", str(src),
                           str(tmp_path / "out" / "html")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"01-lines.md:{len(lines)}: WARNING: undefined label: 'no-such-label'" in proc.stderr, (
        proc.stderr)
    loaded = tmp_path / "out" / "html" / ".doctrees" / "setup-cells" / "01-lines.py"  # loaded
    assert loaded.read_text() == chapter_structure.setup_source(
        chapter_structure.code_files("\n".join(lines)))


# --- figures and timing sentences ----------------------------------------------------------------

DECIMAL = re.compile(r"(?<![\w.])\d*\.\d+")
# Words that make a sentence a claim about running time; "grows faster than d_k" is not one.
TIMING = re.compile(r"(?<!grow )(?<!grows )(?<!decay )(?<!decays )(?<!fall )(?<!falls )"
                    r"\b(faster|slower|fastest|slowest|speed-?ups?|slowdown|quicker|"
                    r"milliseconds?|microseconds?|wall-clock time)\b|\d\s*(ms|µs)\b", re.I)
SUPPORTED_TIMING = re.compile(r"\{glue|\{cite|\byour\b|\blook for\b", re.I)


def timing_claim(sentence: str) -> bool:
    return bool(TIMING.search(sentence))


def figure_cells(path: pathlib.Path):
    """(cell, name, caption and alt text) of every figure of a chapter: a code cell with
    myst-nb figure metadata, or one that shows an explorable figure (whose alt text is
    explorable()'s argument, computed in the cell)."""
    import jupytext

    for cell in jupytext.read(path).cells:
        if cell.cell_type != "code":
            continue
        meta = cell.metadata.get("mystnb", {})
        figure = meta.get("figure")
        if figure or re.search(r"^explorable\(", cell.source, re.M):
            name = (figure or {}).get("name") or "explorable figure"
            text = (figure or {}).get("caption", "") + " " + meta.get("image", {}).get("alt", "")
            yield cell, name, text


def prose_sentences(path: pathlib.Path) -> list[str]:
    """The sentences of a chapter's markdown, without code blocks and display math."""
    import jupytext

    sentences = []
    for cell in jupytext.read(path).cells:
        if cell.cell_type != "markdown":
            continue
        text = re.sub(r"```.*?```|\$\$.*?\$\$", " ", cell.source, flags=re.S)
        sentences += [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+(?=[A-Z{(])", text)]
    return sentences


@pytest.mark.parametrize("name", chapter_structure.TEACHING_FILES)
def test_every_public_function_of_a_teaching_module_is_in_its_all(name):
    """`from module import *` gives what the module defines: each public function and class
    that a teaching module defines is listed in its __all__."""
    import importlib
    import inspect

    module = importlib.import_module(name.removesuffix(".py"))
    public = [n for n, obj in vars(module).items()
              if not n.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
              and obj.__module__ == module.__name__]
    assert public and sorted(set(public) - set(module.__all__)) == []

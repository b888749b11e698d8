"""Static checks of the chapter sources: the conventions every chapter promises its readers."""

from __future__ import annotations

import pathlib
import re

import pytest

from classroom import numbered_chapters, setup_cell
from conftest import toc_docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"

SETUP_CELL = setup_cell()  # tools/classroom.py renders it with the URL from _config.yml


def test_toc_and_chapter_folder_agree():
    docs = toc_docs()
    for doc in docs:
        assert (ROOT / f"{doc}.md").is_file(), f"_toc.yml lists {doc}, which does not exist"
    on_disk = {f"chapters/{p.stem}" for p in CHAPTERS.glob("*.md")}
    assert on_disk == set(docs), f"pages not in the toc: {on_disk - set(docs)}"


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
    def test_setup_cell_is_the_shared_one(self, path):
        text = path.read_text()
        first = text.index("```{code-cell}")
        assert text[first:first + len(SETUP_CELL)] == SETUP_CELL, (
            "the first cell differs from tools/classroom.py's template (after changing "
            "_config.yml's repository, run `python tools/classroom.py setup-cell`)")

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
        text = path.read_text()
        exercises = re.findall(r"```\{exercise\}[^\n]*\n:label: (\S+)", text)
        assert len(exercises) >= 3
        for label in exercises:
            assert re.search(rf"\{{solution(-start)?\}} {label}\n:class: dropdown", text), (
                f"{label} has no collapsed solution"
            )
        assert re.search(r"```\{solution-start\}(?:.|\n)*?```\{code-cell\}", text), (
            "no solution with code: at least one coding exercise must check itself"
        )

    def test_timing_cells_are_tagged_wall_clock(self, path):
        # A cell that measures running time gives different numbers on every build; the tag
        # tells the determinism test (tests/test_book.py) that this page may change.
        text = path.read_text()
        if re.search(r"perf_counter|time\.time\(|timeit", text):
            assert re.search(r"tags: \[[^\]]*wall-clock", text), "timing cell without a wall-clock tag"

"""The core path: each chapter's essentials first, its deeper sections marked, reading times.

A chapter marks a section as deeper with MyST's ``rst-class`` directive right before its heading::

    ```{rst-class} deeper
    ```
    ## Why the base is 10000

which gives the section element the class ``deeper`` (print styles, tests and the "Core path"
switch of _static/core-path.js find it there). This extension, as each page is read:

* labels every outermost deeper section with a badge, in its heading and in its entry of the
  page's contents;
* marks every deeper exercise, and its solution, with the class ``deeper-exercise`` and a badge
  at the top of its statement: the exercises whose path is *deeper* in the exercise table of
  chapters/instructors.md, the one list of them (the course plans and the tests read it too),
  so that the switch hides them with the deeper sections, on screen and in print;
* counts the words of a chapter's prose, and of the prose of its core (everything outside the
  deeper sections): paragraphs, lists, proofs and the captions written in the chapter's text
  (a figure drawn by a code cell is output, and its caption is not counted), not code cells
  and their outputs, display math or the exercises and solutions;
* puts the reading time of the core and of the whole chapter under its title.

After every page is read, the ``{reading-routes}`` directive (on the landing page) becomes the
two routes through the book, each with its reading time and its chapters' count.
"""

from __future__ import annotations

import math
import re

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

DEEPER = "deeper"
WORDS_PER_MINUTE = 200  # a careful reading of technical prose
CHAPTER = re.compile(r"chapters/\d\d-[\w-]+$")
# Whole nodes whose text is not prose: code cells and their outputs, display math, literal
# blocks, raw HTML, comments, and the exercises and their solutions (sphinx-exercise's nodes).
SKIPPED_NODES = (nodes.literal_block, nodes.math_block, nodes.raw, nodes.comment,
                 nodes.substitution_definition)
SKIPPED_CLASSES = {"cell", "exercise", "solution", "reading-time", "deeper-badge"}


def is_deeper(node: nodes.Node) -> bool:
    return isinstance(node, nodes.section) and DEEPER in node.get("classes", [])


def _skipped(node: nodes.Element) -> bool:
    if isinstance(node, SKIPPED_NODES):
        return True
    if SKIPPED_CLASSES & set(node.get("classes", [])):
        return True
    name = type(node).__name__
    return name.startswith(("exercise", "solution"))  # sphinx-exercise's nodes


def count_words(doctree: nodes.Node) -> tuple[int, int]:
    """(words of the whole chapter's prose, words of its core's prose)."""
    whole = core = 0

    def walk(node: nodes.Node, deeper: bool) -> None:
        nonlocal whole, core
        if isinstance(node, nodes.Text):
            n = len(re.findall(r"\w+(?:[-'’]\w+)*", node.astext()))
            whole += n
            core += 0 if deeper else n
            return
        if isinstance(node, nodes.math):  # an inline formula reads as one word
            whole += 1
            core += 0 if deeper else 1
            return
        if isinstance(node, nodes.Element):
            if _skipped(node):
                return
            if isinstance(node, nodes.section) and node.get("ids") and "exercises" in node["ids"]:
                return  # the Exercises section: statements and solutions, not counted
            deeper = deeper or is_deeper(node)
            for child in node.children:
                walk(child, deeper)

    walk(doctree, False)
    return whole, core


def minutes(words: int) -> int:
    return max(1, round(words / WORDS_PER_MINUTE))


def outermost_deeper(doctree: nodes.Node) -> list[nodes.section]:
    return [s for s in doctree.findall(nodes.section)
            if is_deeper(s) and not any(is_deeper(p) for p in _ancestors(s))]


def badge() -> nodes.inline:
    return nodes.inline("", "deeper", classes=["deeper-badge"])


def label_deeper_sections(app: Sphinx, doctree: nodes.document) -> None:
    """A badge in the title of every outermost deeper section and in its entry of the page's
    contents. Connected to doctree-read after Sphinx has collected the page's contents and its
    domains the section titles for cross-references, so that a {ref} to the section shows its
    title without the badge."""
    ids = set()
    for section in outermost_deeper(doctree):
        title = section.next_node(nodes.title)
        if title is not None:
            title += nodes.Text(" ")
            title += badge()
        ids.update(section["ids"])
    toc = app.env.tocs.get(app.env.docname)
    if toc is None or not ids:
        return
    for reference in toc.findall(nodes.reference):
        if reference.get("anchorname", "").lstrip("#") in ids:
            reference += nodes.Text(" ")
            reference += badge()


# A row of the exercise table in chapters/instructors.md: its number and its path.
EXERCISE_ROW = re.compile(r"^\| (\d+\.\d+) \| .+? \| \w+, (?:auto|by hand) \| \d+ \| \d+ \| "
                          r"(core|deeper) \|", re.M)


def exercise_paths(srcdir) -> dict[str, str]:
    """{"2.1": "core" or "deeper"} for every exercise of the table in chapters/instructors.md."""
    import pathlib

    table = pathlib.Path(srcdir, "chapters", "instructors.md").read_text(encoding="utf-8")
    return dict(EXERCISE_ROW.findall(table))


def mark_deeper_exercises(app: Sphinx, doctree: nodes.document) -> None:
    """The class deeper-exercise, and a badge with a line saying why, on every exercise of this
    chapter that the table calls deeper, and the class on its solution."""
    match = re.search(r"chapters/(\d\d)-", app.env.docname)
    if not match:
        return
    paths = exercise_paths(app.srcdir)
    chapter = int(match.group(1))
    exercises = [n for n in doctree.findall(nodes.Element)
                 if type(n).__name__ == "exercise_enumerable_node"]
    deeper_labels = set()
    for number, exercise in enumerate(exercises, start=1):
        if paths.get(f"{chapter}.{number}") != "deeper":
            continue
        exercise["classes"].append("deeper-exercise")
        deeper_labels.add(exercise["label"])
        note = nodes.paragraph("", "", badge(), nodes.Text(
            " Builds on a deeper section: the core path leaves this exercise out."),
            classes=["deeper-exercise-note"])
        body = next((c for c in exercise.children if isinstance(c, nodes.section)), None)
        (body if body is not None else exercise).insert(0, note)
    for solution in doctree.findall(nodes.Element):
        if type(solution).__name__ == "solution_node" and solution.get("target_label") in deeper_labels:
            solution["classes"].append("deeper-exercise")


def record_reading_time(app: Sphinx, doctree: nodes.document) -> None:
    """Count a chapter's words and put its reading times under its title."""
    env = app.env
    if not hasattr(env, "core_path_words"):
        env.core_path_words = {}
    docname = env.docname
    if not CHAPTER.search(docname):
        env.core_path_words.pop(docname, None)
        return
    whole, core = count_words(doctree)
    env.core_path_words[docname] = (whole, core)
    title = doctree.next_node(nodes.title)
    if title is None:
        return
    sections = len(outermost_deeper(doctree))
    text = (f"Reading time: core path {minutes(core)} min, whole chapter {minutes(whole)} min "
            f"({sections} deeper section{'s' * (sections != 1)}; prose at {WORDS_PER_MINUTE} "
            f"words a minute, code and exercises extra).")
    paragraph = nodes.paragraph("", "", nodes.Text(text), classes=["reading-time"])
    title.parent.insert(title.parent.index(title) + 1, paragraph)


def _ancestors(node: nodes.Node):
    node = node.parent
    while node is not None:
        yield node
        node = node.parent


class reading_routes(nodes.General, nodes.Element):  # noqa: N801 - docutils' node naming
    """Where the two routes go, filled in once every chapter has been read."""


class ReadingRoutes(SphinxDirective):
    has_content = False

    def run(self):
        return [reading_routes("")]


def fill_routes(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    words = getattr(app.env, "core_path_words", {})
    for node in list(doctree.findall(reading_routes)):
        whole = sum(w for w, _ in words.values())
        core = sum(c for _, c in words.values())
        hours = lambda words: f"{words / WORDS_PER_MINUTE / 60:.1f}"  # noqa: E731
        items = nodes.bullet_list()
        for name, count, text in (
            ("The core path", core, "each chapter's core sections and the exercises they "
             "are enough for. The Core path switch at the top of every page, beside the theme "
             "switch, hides the deeper sections and exercises, on screen and in print."),
            ("The whole book", whole, "every section, the deeper ones included: variations of "
             "the proofs, the experiments that go past the core, and PyTorch's behaviour "
             "version by version."),
        ):
            paragraph = nodes.paragraph()
            paragraph += nodes.strong("", name)
            paragraph += nodes.Text(f": about {hours(count)} hours of reading over "
                                    f"{len(words)} chapters ({count:,} words of prose), {text}")
            items += nodes.list_item("", paragraph)
        node.replace_self(items)


def merge_words(app, env, docnames, other) -> None:
    if not hasattr(env, "core_path_words"):
        env.core_path_words = {}
    env.core_path_words.update(getattr(other, "core_path_words", {}))


def purge_words(app, env, docname) -> None:
    getattr(env, "core_path_words", {}).pop(docname, None)


def setup(app: Sphinx) -> dict:
    app.add_node(reading_routes)
    app.add_directive("reading-routes", ReadingRoutes)
    app.connect("doctree-read", record_reading_time)
    app.connect("doctree-read", label_deeper_sections, priority=600)  # after the collectors
    app.connect("doctree-read", mark_deeper_exercises)
    app.connect("doctree-resolved", fill_routes)
    app.connect("env-merge-info", merge_words)
    app.connect("env-purge-doc", purge_words)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True,
            "env_version": 1}

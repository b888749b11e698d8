"""The core path on the built site: every chapter's core within its budget and readable on its
own, its deeper sections marked, and the Core path switch working in a real browser.

The budgets are measured on the built pages, independently of the reading times that
_ext/core_path.py computes: the prose of a chapter is the text of its article without code
cells and their outputs (figures included), display math, literal blocks, the exercises and
their solutions, the reading-time line and the badges; an inline formula is one word.
"""

from __future__ import annotations

import copy
import functools
import pathlib
import posixpath
import re
import sys
import urllib.parse

import pytest

import site_browser as sb

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "_ext"))
from core_path import exercise_paths  # noqa: E402  (the instructors' table, as the build reads it)

# the browser visits start with this file's first test (tests/conftest.py)
pytestmark = [pytest.mark.book, pytest.mark.usefixtures("site_visits_started")]

CORE_WORDS = 2000  # at most, per chapter
CORE_SHARE = 0.60  # of the chapter's prose, at most
WORD = re.compile(r"\w+(?:[-'’]\w+)*")


def chapter_pages(html_dir: pathlib.Path) -> list[str]:
    return [f"{doc}.html" for doc in sb.toc_docs() if re.search(r"chapters/\d\d-", doc)]


def article(html_dir: pathlib.Path, page: str):
    """The page's article element, parsed once per file and version and shared by every test:
    a test that changes it works on a copy (copy.copy)."""
    path = html_dir / page
    return _parsed_article(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _parsed_article(path: pathlib.Path, mtime_ns: int):
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")
    return soup.select_one("article.bd-article")


def _not_prose(tag) -> bool:
    """Code cells, display math, exercises and their solutions, the reading time, the deeper
    badge, the closing exercises section, hidden toggles, scripts and styles."""
    classes = tag.get("class") or ()
    return (tag.name in ("pre", "script", "style")
            or tag.name == "div" and any(c in classes for c in
                                         ("cell", "math", "exercise", "solution", "toggle-hidden"))
            or tag.name == "p" and "reading-time" in classes
            or tag.name == "span" and "deeper-badge" in classes
            or tag.name == "section" and tag.get("id") == "exercises")


def prose_words(node) -> tuple[int, int]:
    """(words of the prose, words of the core's prose) of an article element: its text as
    get_text gives it, less what _not_prose names, each inline formula one word, and the core
    without the sections marked deeper. One walk over the shared tree, which it leaves as it is
    (a copy to cut from cost 0.5 s a chapter)."""
    from bs4 import CData, NavigableString, Tag

    whole = core = 0
    todo = [(node, False)]
    while todo:
        element, deeper = todo.pop()
        for child in element.children:
            if isinstance(child, Tag):
                classes = child.get("class") or ()
                if _not_prose(child):
                    continue
                if child.name == "span" and "math" in classes:
                    whole, core = whole + 1, core + (not deeper)  # " formula "
                    continue
                todo.append((child, deeper or child.name == "section" and "deeper" in classes))
            elif type(child) in (NavigableString, CData):  # what get_text reads
                words = len(WORD.findall(child))
                whole, core = whole + words, core + (0 if deeper else words)
    return whole, core


def test_every_chapter_core_is_within_its_budget(build):
    _, _, out = build
    html_dir = out / "html"
    over, report = [], []
    for page in chapter_pages(html_dir):
        whole, core = prose_words(article(html_dir, page))
        report.append(f"{page}: core {core} of {whole} words ({core / whole:.0%})")
        if core > CORE_WORDS or core > CORE_SHARE * whole:
            over.append(report[-1])
    print("\n" + "\n".join(report))
    assert not over, (f"cores over {CORE_WORDS} words or {CORE_SHARE:.0%} of their chapter:\n"
                      + "\n".join(over))


def test_every_chapter_marks_its_depth_after_its_core(build):
    """Deeper sections exist, are labelled in heading and contents, and come after the core
    sections (the summary, exercises and further reading close the chapter)."""
    _, _, out = build
    html_dir = out / "html"
    problems = []
    closing = {"summary", "exercises", "further-reading"}
    for page in chapter_pages(html_dir):
        body = article(html_dir, page)
        top = body.select_one("section").find_all("section", recursive=False)
        kinds = ["closing" if s.get("id") in closing else
                 "deeper" if "deeper" in (s.get("class") or []) else "core" for s in top]
        if "deeper" not in kinds:
            problems.append(f"{page}: no deeper section")
        elif "core" in kinds[kinds.index("deeper"):]:
            problems.append(f"{page}: a core section after a deeper one: {kinds}")
        for section in body.select("section.deeper"):
            if section.find_parent("section", class_="deeper"):
                continue
            heading = section.find(re.compile(r"h\d"))
            if not heading.select_one("span.deeper-badge"):
                problems.append(f"{page}: #{section['id']} has no badge in its heading")
        toc = (html_dir / page).read_text(encoding="utf-8")
        for section in body.select("section.deeper"):
            if section.find_parent("section", class_="deeper"):
                continue
            entry = re.search(rf'href="#{re.escape(section["id"])}">(.*?)</a>', toc)
            if not entry or "deeper-badge" not in entry.group(1):
                problems.append(f"{page}: #{section['id']} is not labelled in the contents")
    assert not problems, "\n".join(problems)


def deeper_ids(html_dir: pathlib.Path, pages: list[str]) -> dict[str, set[str]]:
    """{page: the ids of its deeper sections and of everything inside them}."""
    return {page: {el["id"] for section in article(html_dir, page).select("section.deeper")
                   for el in [section, *section.select("[id]")]} for page in pages}


def links_into_deeper(page: str, links, deeper: dict[str, set[str]]) -> list:
    """The links (from `page`) whose target lies inside a deeper section of the book."""
    found = []
    for link in links:
        parts = urllib.parse.urlsplit(link["href"])
        if parts.scheme or not parts.fragment:
            continue
        target = page if not parts.path else posixpath.normpath(
            posixpath.join(posixpath.dirname(page), parts.path))
        if urllib.parse.unquote(parts.fragment) in deeper.get(target, ()):
            found.append(link)
    return found


def test_no_core_section_links_to_a_deeper_one(build):
    """The core reads on its own: nothing outside the deeper sections (and the exercises,
    which are marked core or deeper on the instructors' page) links into a deeper section."""
    _, _, out = build
    html_dir = out / "html"
    pages = chapter_pages(html_dir)
    deeper = deeper_ids(html_dir, pages)
    problems = []
    for page in pages + ["chapters/intro.html", "chapters/notation.html"]:
        core_links = [link for link in article(html_dir, page).select("a[href]")
                      if not link.find_parent("section", class_="deeper")
                      and not link.find_parent("section", id="exercises")]
        problems += [f"{page}: core text links to {link['href']} "
                     f"({link.get_text(' ', strip=True)[:40]!r})"
                     for link in links_into_deeper(page, core_links, deeper)]
    assert not problems, "\n".join(problems)


def test_reading_times_and_routes_are_computed_not_typed(build):
    _, _, out = build
    html_dir = out / "html"
    for page in chapter_pages(html_dir):
        line = article(html_dir, page).select_one("p.reading-time")
        assert line, f"{page}: no reading time under the title"
        core, whole = map(int, re.findall(r"(\d+) min", line.get_text()))
        assert 1 <= core < whole, (page, line.get_text())
    intro = article(html_dir, "chapters/intro.html").get_text(" ")
    assert re.search(r"The core path\s*: about [\d.]+ hours", intro)
    assert re.search(r"The whole book\s*: about [\d.]+ hours", intro)


# --- the switch, in Chromium ---------------------------------------------------------------------

STATE_JS = """() => ({
  mode: document.documentElement.dataset.corePath,
  pressed: document.querySelector('.core-path-button')?.getAttribute('aria-pressed'),
  status: document.querySelector('.core-path-status')?.textContent || '',
  deeperShown: [...document.querySelectorAll('section.deeper, div.deeper-exercise')]
    .filter(s => !s.parentElement.closest('section.deeper'))
    .map(s => s.getBoundingClientRect().height > 0),
  entriesShown: [...document.querySelectorAll('li.deeper-entry')]
    .map(li => getComputedStyle(li).display !== 'none'),
  besideTheme: document.querySelector('.core-path-button')?.nextElementSibling?.nextElementSibling
    ?.classList.contains('theme-switch-button') || false,
})"""


SWITCH_ACROSS_PAGES = "chapters/01-intuition.html"  # the page whose visit also follows a link
SWITCH_FOLLOWED_TO = "chapters/14-build-it-yourself.html"  # to the quickest chapter to load
# `make test` looks at the switch in print on one chapter (print keeps what the switch hid by the
# same stylesheet on every page; a long page takes up to half a second to lay out for print);
# `make check-release` on every chapter, in the dark theme
PRINTED_IN_TEST = SWITCH_ACROSS_PAGES


def switch_check(page, url: str, path: str, printed: bool = True) -> dict:
    """On a chapter page already open at desktop width (a step of the site's one visit per page,
    tests/test_site.py, the last on SWITCH_ACROSS_PAGES): turn the switch on by keyboard, look,
    print (if `printed`), and turn it off again with Space. On SWITCH_ACROSS_PAGES it also opens
    another chapter in between, where the switch must still be on (the browser context keeps
    local storage between pages)."""
    page.evaluate("() => scrollTo(0, 0)")
    report = {"off": page.evaluate(STATE_JS)}
    page.focus(".core-path-button")
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.querySelector('.core-path-status').textContent")
    report["on"] = page.evaluate(STATE_JS)
    if printed:
        page.emulate_media(media="print")
        report["printed"] = page.evaluate(STATE_JS)
        page.emulate_media(media="screen")
    if path == SWITCH_ACROSS_PAGES:
        sb.open_page(page, url[: -len(path)] + SWITCH_FOLLOWED_TO)
        report["reloaded"] = page.evaluate(STATE_JS)
    page.focus(".core-path-button")
    page.keyboard.press("Space")
    report["off_again"] = page.evaluate(STATE_JS)
    return report


def switch_problems(switched: dict) -> list[str]:
    """What is wrong with the switch, from {page: switch_check's report}."""
    problems = []
    for page, r in switched.items():
        if not r["off"]["besideTheme"]:
            problems.append(f"{page}: the switch is not beside the theme switch")
        if r["off"]["mode"] != "off" or r["off"]["pressed"] != "false" or not all(
                r["off"]["deeperShown"]):
            problems.append(f"{page}: off at first, every section shown: {r['off']}")
        for state in ("on", "printed", "reloaded"):
            if state not in r:
                continue
            s = r[state]
            if s["mode"] != "on" or any(s["deeperShown"]) or any(s["entriesShown"]) or (
                    state != "printed" and s["pressed"] != "true"):
                problems.append(f"{page}: {state}: {s}")
        if not re.search(r"deeper sections? hidden", r["on"]["status"]):
            problems.append(f"{page}: nothing announced: {r['on']['status']!r}")
        if r["off_again"]["mode"] != "off" or not all(r["off_again"]["deeperShown"]):
            problems.append(f"{page}: off again: {r['off_again']}")
    if not any("reloaded" in r for r in switched.values()):
        problems.append(f"the switch was never followed to another page ({SWITCH_ACROSS_PAGES})")
    if not any("printed" in r for r in switched.values()):
        problems.append("the switch was never looked at in print")
    return problems


def test_the_core_path_switch_hides_and_shows_the_deeper_sections(site):
    """In the light theme, from the one visit of each page (the `site` fixture of conftest.py);
    `make check-release` does the same in the dark theme."""
    html_dir, reports = site
    switched = {page: reports[page]["core_switch"] for page in chapter_pages(html_dir)}
    assert not switch_problems(switched), "\n".join(switch_problems(switched))


def core_pdf_problems(html_dir: pathlib.Path, pdf_text: str, pages: list[str]) -> list[str]:
    """What is wrong with a core-path PDF's text for the chapter `pages` it printed: a deeper
    section's numbered heading printed, a core section's missing, or no core-path title."""
    import unicodedata

    # NFKC undoes the ligatures of the PDF's text ("ﬁ" for "fi"); its spaces are unreliable.
    squeeze = lambda s: "".join(s.split())  # noqa: E731 - the PDF's text loses its spaces
    text = unicodedata.normalize("NFKC", squeeze(pdf_text))
    problems = []
    for page in pages:
        for section in article(html_dir, page).select("section > section"):
            heading = section.find(re.compile(r"h\d"), recursive=False)
            if heading is None:
                continue
            heading = copy.copy(heading)  # the parsed article is shared: change a copy
            for junk in heading.select("a.headerlink, span.deeper-badge"):
                junk.decompose()
            # With its number ("5.6. The fully masked row"), a heading is told apart from the
            # same words in the text, a summary or an exercise.
            words = squeeze(heading.get_text())
            if not heading.select_one("span.section-number") or heading.select_one("span.math"):
                continue  # no number to tell it apart, or a formula the PDF's text spells otherwise
            deeper = section.find_parent("section", class_="deeper") or "deeper" in (
                section.get("class") or [])
            if deeper and words in text:
                problems.append(f"{page}: deeper section printed: {heading.get_text(strip=True)}")
            elif not deeper and words not in text:
                problems.append(f"{page}: core section missing: {heading.get_text(strip=True)}")
    if "Attention,Computed:thecorepath" not in text[:2000]:
        problems.append("no core-path title page")
    return problems


@pytest.mark.release
def test_the_core_path_prints_as_a_book_without_its_deeper_sections(build, tmp_path):
    """`make pdf` also writes the core path: the same pages with the switch on, so that no
    deeper section's heading is printed while every core section's is (`make test` prints a
    few pages the same way, tests/test_site.py)."""
    import test_site

    _, _, out = build
    html_dir = out / "html"
    _, text = test_site.printed_book(html_dir, tmp_path / "book-core.pdf", core=True)
    problems = core_pdf_problems(html_dir, text, chapter_pages(html_dir))
    assert not problems, "\n".join(problems)


def test_core_exercises_link_no_deeper_section(build):
    """An exercise marked core on the instructors' page can be done from the core path: its
    statement links no deeper section of any chapter."""
    _, _, out = build
    html_dir = out / "html"
    path = exercise_paths(ROOT)
    pages = chapter_pages(html_dir)
    deeper = deeper_ids(html_dir, pages)
    problems, seen = [], set()
    for page in pages:
        for exercise in article(html_dir, page).select("div.exercise"):
            title = exercise.select_one(".admonition-title")
            number = re.search(r"Exercise (\d+\.\d+)", title.get_text(" ") if title else "")
            if not number:
                continue
            seen.add(number.group(1))
            if path.get(number.group(1)) != "core":
                continue
            problems += [f"core exercise {number.group(1)} links {link['href']}"
                         for link in links_into_deeper(page, exercise.select("a[href]"), deeper)]
    assert seen == set(path), f"exercises on the pages {sorted(seen)} and in the table differ"
    assert not problems, "\n".join(problems)


def test_every_deeper_exercise_and_its_solution_are_marked_on_the_page(build):
    """The exercises the instructors' table calls deeper carry the class the switch hides (and
    a badge saying why), and so do their solutions; no other exercise does."""
    _, _, out = build
    html_dir = out / "html"
    path = exercise_paths(ROOT)
    marked, problems = set(), []
    for page in chapter_pages(html_dir):
        body = article(html_dir, page)
        for exercise in body.select("div.exercise"):
            title = exercise.select_one(".admonition-title")
            number = re.search(r"Exercise (\d+\.\d+)", title.get_text(" ")).group(1)
            if "deeper-exercise" not in exercise.get("class", []):
                continue
            marked.add(number)
            if not exercise.select_one("p.deeper-exercise-note span.deeper-badge"):
                problems.append(f"exercise {number}: no badge")
            solutions = [s for s in body.select("div.solution")
                         if s.select_one(f'a[href="#{exercise["id"]}"]')]
            if not solutions or any("deeper-exercise" not in s.get("class", []) for s in solutions):
                problems.append(f"exercise {number}: its solution is not marked")
    assert marked == {n for n, p in path.items() if p == "deeper"}
    assert not problems, "\n".join(problems)

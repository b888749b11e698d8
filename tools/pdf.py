"""The whole book as one PDF, printed from the built HTML site by Chromium (`make pdf`).

    python tools/pdf.py [HTML_DIR] [OUT_PDF] [--core]
                          defaults: _build/html, _build/pdf/book.pdf (book-core.pdf with --core)

With --core it prints the core path: the pages as a reader sees them with the "Core path"
switch on (_static/core-path.js), every deeper section left out.

Every page of _toc.yml, in reading order, is opened offline in the Chromium the site tests use
(tools/site_browser.py), its math typeset by the MathJax the site ships, and printed with the
theme's print stylesheet (no navigation bars; figures as SVG, so they stay sharp). The pages
are joined with pypdf behind a title page and a table of contents that gives each page's first
page number; every page gets its number in the footer, and the PDF's outline (bookmarks)
lists the pages.

Why this route and not Jupyter Book's LaTeX builder: myst-nb's LaTeX output cannot include
the SVG figures every chapter draws, and LaTeX needs a TeX installation of a few hundred MB;
Jupyter Book's own `pdfhtml` builder does what this does but with pyppeteer, which downloads
a browser of its own. The price: links between chapters become links to the web pages, and
the page numbers of the contents are those of the printed pages, not of sections.
"""

from __future__ import annotations

import html
import io
import pathlib
import sys
import time

import site_browser as sb

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = {"format": "A4", "margin": {"top": "16mm", "bottom": "18mm", "left": "16mm",
                                   "right": "16mm"}}

# Printing wraps code that would run past the right edge, and keeps figures and equations whole.
PRINT_CSS = """
@media print {
  pre, pre code { white-space: pre-wrap !important; word-break: break-word; }
  figure, .MathJax_Display, mjx-container[display="true"], table { break-inside: avoid; }
  h1, h2, h3 { break-after: avoid; }
}
"""


def toc_pages() -> list[str]:
    """The pages of _toc.yml in reading order, as paths of the built site."""
    return [f"{doc}.html" for doc in sb.toc_docs()]


def _front_matter(page, title: str, contents: list[tuple[str, int]]) -> bytes:
    """A title page and the table of contents, printed from HTML made here."""
    rows = "\n".join(f"<tr><td>{html.escape(name)}</td><td class=n>{number}</td></tr>"
                     for name, number in contents)
    page.set_content(f"""<!doctype html><html><head><meta charset="utf-8"><style>
      body {{ font-family: sans-serif; }}
      .title {{ height: 240mm; display: flex; flex-direction: column; justify-content: center;
               text-align: center; break-after: page; }}
      .title h1 {{ font-size: 34pt; margin: 0 0 8mm; }}
      table {{ width: 100%; border-collapse: collapse; font-size: 12pt; }}
      td {{ padding: 2mm 0; border-bottom: 1px dotted #999; }} td.n {{ text-align: right; }}
    </style></head><body>
      <div class="title"><h1>{html.escape(title)}</h1>
        <p>An interactive textbook on the attention mechanism of Transformers, printed from
        its web edition. Every number that a cell computes and the text quotes, and every
        figure a cell draws, comes from the code beside it, run when the book was built.</p></div>
      <h2>Contents</h2><table>{rows}</table></body></html>""")
    return page.pdf(**PAGE)


def _page_numbers(page, count: int, first: int) -> bytes:
    """`count` blank pages whose footers say first, first + 1, ...: stamped onto the book's."""
    numbers = "".join(f'<div class="p"><span>{first + i}</span></div>' for i in range(count))
    page.set_content(f"""<!doctype html><html><head><style>
      @page {{ size: A4; margin: 0; }} body {{ margin: 0; font: 9pt sans-serif; color: #555; }}
      .p {{ height: 297mm; position: relative; break-after: page; }}
      .p span {{ position: absolute; bottom: 8mm; width: 100%; text-align: center; }}
    </style></head><body>{numbers}</body></html>""")
    return page.pdf(format="A4", margin={"top": "0", "bottom": "0", "left": "0", "right": "0"})


CORE_PATH_KEY = "attention-computed:core-path"  # where _static/core-path.js keeps the switch


def print_book(html_dir: pathlib.Path, out: pathlib.Path, core: bool = False,
               pages: list[str] | None = None) -> dict:
    """Print every page of the book (or only `pages`, in the book's order) into one PDF at
    `out`; {page: (title, first page)}. With `core`, the core path: the switch on, every deeper
    section hidden."""
    from playwright.sync_api import sync_playwright
    from pypdf import PdfReader, PdfWriter

    pages = [p for p in toc_pages() if pages is None or p in pages]
    missing = [p for p in pages if not (html_dir / p).is_file()]
    if missing:
        raise SystemExit(f"{html_dir} lacks {', '.join(missing)}: run `make book` first")
    book_title = "Attention, Computed" + (": the core path" if core else "")

    def print_page(page, url: str, path: str, external: list) -> tuple[str, bytes]:
        if not sb.open_page(page, url) and sb.page_has_math(html_dir / path):
            raise SystemExit(f"{path}: MathJax did not run")
        page.add_style_tag(content=PRINT_CSS)
        page.emulate_media(media="print")
        title = page.locator("main h1").first.inner_text().strip().rstrip("#").strip()
        number = pathlib.PurePath(path).name.split("-", 1)[0]
        if number.isdigit():  # a numbered chapter, as the site's navigation numbers it
            title = f"{int(number)}. {title}"
        return title, page.pdf(print_background=True, outline=True, tagged=True, **PAGE)

    # Two browsers print the pages side by side (site_browser.visit_pages), with the switch as a
    # reader left it set before any page script runs; the results come back in reading order.
    printed = sb.visit_pages(html_dir, pages, print_page, init_script=(
        f"localStorage.setItem({CORE_PATH_KEY!r}, {'on' if core else 'off'!r})"))
    with sync_playwright() as playwright:
        browser = sb.launch(playwright)
        blank, _ = sb.offline_page(browser.new_context())
        # The front matter's length does not depend on the numbers in it: print it once to
        # count its pages, then again with the numbers.
        titles = [title for title, _ in printed.values()]
        lengths = [len(PdfReader(io.BytesIO(pdf)).pages) for _, pdf in printed.values()]
        front_length = len(PdfReader(io.BytesIO(
            _front_matter(blank, book_title, [(t, 0) for t in titles]))).pages)
        starts, next_page = [], front_length + 1
        for length in lengths:
            starts.append(next_page)
            next_page += length
        front = _front_matter(blank, book_title, list(zip(titles, starts)))
        stamps = PdfReader(io.BytesIO(_page_numbers(blank, next_page - 1 - front_length,
                                                    front_length + 1)))
        browser.close()

    writer = PdfWriter()
    writer.append(PdfReader(io.BytesIO(front)))
    stamp = iter(stamps.pages)
    for (title, pdf), start in zip(printed.values(), starts):
        reader = PdfReader(io.BytesIO(pdf))
        for chapter_page in reader.pages:
            writer.add_page(chapter_page).merge_page(next(stamp))
        writer.add_outline_item(title=title, page_number=start - 1)
    writer.add_metadata({"/Title": book_title})
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as handle:
        writer.write(handle)
    return {path: (title, start) for (path, (title, _)), start in zip(printed.items(), starts)}


def main(html_dir: pathlib.Path, out: pathlib.Path, core: bool = False) -> int:
    started = time.perf_counter()
    try:
        contents = print_book(html_dir, out, core=core)
    except RuntimeError as err:  # no Chromium: the message names the fix
        print(err, file=sys.stderr)
        return 1
    for title, start in contents.values():
        print(f"{start:4d}  {title}")
    print(f"{out}: written in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    core = "--core" in sys.argv[1:]
    args = [pathlib.Path(a) for a in sys.argv[1:] if a != "--core"][:2]
    default = ROOT / "_build" / "pdf" / ("book-core.pdf" if core else "book.pdf")
    sys.exit(main(args[0] if args else ROOT / "_build" / "html",
                  args[1] if len(args) > 1 else default, core=core))

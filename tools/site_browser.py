"""Shared helpers to look at the built site as a reader does: serve it on localhost and open
its pages in headless Chromium, offline.

Used by tests/test_site.py (the browser, accessibility and keyboard checks) and by
tools/screenshots.py (`make screenshots`). The browser is the Chromium that `make browser`
(tools/chromium.py) found or installed, driven by playwright-python.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import http.server
import pathlib
import posixpath
import queue
import re
import threading
import urllib.parse
from collections.abc import Iterator

import chromium

DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}

LOCAL_HOSTS = {"127.0.0.1", "localhost"}


def toc_docs() -> list[str]:
    """The root page and every file of _toc.yml, in reading order (without suffix)."""
    import yaml

    toc = yaml.safe_load((pathlib.Path(__file__).resolve().parents[1] / "_toc.yml").read_text())
    entries = list(toc.get("chapters", []))
    for part in toc.get("parts", []):
        entries += part["chapters"]
    return [toc["root"]] + [entry["file"] for entry in entries]


def html_pages(html_dir: pathlib.Path) -> list[str]:
    """Every page of the built site, as paths relative to html_dir (theme templates left out)."""
    skip = {"_static", "_sources", "_images"}
    return sorted(p.relative_to(html_dir).as_posix() for p in html_dir.rglob("*.html")
                  if not skip & set(p.relative_to(html_dir).parts[:-1]))


_REFRESH = re.compile(r'<meta http-equiv="refresh" content="\d+;\s*url=([^"]+)"', re.IGNORECASE)


def redirect_target(html_dir: pathlib.Path, page: str) -> str | None:
    """For a page that only redirects (Jupyter Book's root index.html), the page it goes to,
    relative to html_dir; None for a real page."""
    match = _REFRESH.search((html_dir / page).read_text(encoding="utf-8")[:2000])
    if not match:
        return None
    return posixpath.normpath(posixpath.join(posixpath.dirname(page), match.group(1)))


def page_has_math(html_file: pathlib.Path) -> bool:
    """Whether Sphinx wrote any math into this page (span.math or div.math)."""
    return 'class="math notranslate nohighlight"' in html_file.read_text(encoding="utf-8")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


@contextlib.contextmanager
def serve(directory: pathlib.Path) -> Iterator[str]:
    """Serve directory on 127.0.0.1 at a free port, in a thread; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def is_local(url: str) -> bool:
    """True for the site on localhost and for URLs that need no network at all."""
    parsed = urllib.parse.urlparse(url)
    return parsed.scheme in {"data", "blob", "about"} or parsed.hostname in LOCAL_HOSTS


def launch(playwright):
    """Start the recorded Chromium headless; RuntimeError naming the fix when there is none."""
    return playwright.chromium.launch(executable_path=chromium.recorded(), args=chromium.ARGS,
                                      headless=True)


def offline_page(context) -> tuple:
    """A new page that can reach only localhost: every other request is aborted, as with no
    network. Returns (page, external), external collecting the URLs of aborted requests."""
    page, external = context.new_page(), []

    def route(route):
        if is_local(route.request.url):
            route.continue_()
        else:
            external.append(route.request.url)
            route.abort("internetdisconnected")

    page.route("**/*", route)
    return page, external


def visit_pages(html_dir: pathlib.Path, pages: list[str], visit, viewport: dict = DESKTOP,
                workers: int = 2, init_script: str | None = None, **context_options) -> dict:
    """Serve html_dir and call visit(page, url, path, external) for each path of `pages`, each in
    a fresh offline page (see offline_page) that is closed afterwards; context_options go to
    Playwright's new_context (color_scheme="dark", java_script_enabled=False), and init_script,
    if given, runs in every page before its own scripts. The pages are shared out
    among `workers` threads, each driving its own Chromium (the machine has two cores; a page
    spends most of its time in the browser running MathJax or axe-core). Returns
    {path: what visit returned}, in the order of `pages`. Raises RuntimeError when Chromium is
    missing."""
    from playwright.sync_api import sync_playwright

    todo = queue.SimpleQueue()
    for path in pages:
        todo.put(path)
    results: dict = {}

    def worker(base: str) -> None:
        with sync_playwright() as playwright:
            browser = launch(playwright)
            context = browser.new_context(viewport=viewport, **context_options)
            if init_script:
                context.add_init_script(init_script)
            try:
                while True:
                    try:
                        path = todo.get_nowait()
                    except queue.Empty:
                        return
                    page, external = offline_page(context)
                    try:
                        results[path] = visit(page, base + path, path, external)
                    finally:
                        page.close()
            finally:
                browser.close()

    with serve(html_dir) as base, concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(worker, base) for _ in range(max(1, min(workers, len(pages))))]:
            future.result()
    return {path: results[path] for path in pages}


# Waits until MathJax (if the page loads it) has typeset the page and its fonts have loaded.
# Resolves to false when the page has MathJax's configuration but MathJax itself never ran.
WAIT_FOR_MATH_JS = """async () => {
  if (window.MathJax && window.MathJax.startup && window.MathJax.startup.promise) {
    await window.MathJax.startup.promise;
  }
  await document.fonts.ready;
  return Boolean(window.MathJax && window.MathJax.startup);
}"""


def open_page(page, url: str) -> bool:
    """Load url and wait for its math and fonts; returns whether MathJax ran."""
    page.goto(url, wait_until="load")
    return page.evaluate(WAIT_FOR_MATH_JS)

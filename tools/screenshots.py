"""Full-page screenshots of every page of the built site, desktop- and phone-width.

    python tools/screenshots.py [HTML_DIR] [OUT_DIR]      (`make screenshots`)

Defaults: _build/html and _build/screenshots. Writes OUT_DIR/desktop-1280/<page>.png and
OUT_DIR/phone-390/<page>.png, one per page, offline and after the math is typeset, with the
same server and browser as the site tests (tools/site_browser.py).
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import time

import site_browser as sb

ROOT = pathlib.Path(__file__).resolve().parents[1]
WIDTHS = {"desktop-1280": sb.DESKTOP, "phone-390": sb.PHONE}


def main(html_dir: pathlib.Path, out_dir: pathlib.Path) -> int:
    if not (html_dir / "index.html").is_file():
        print(f"no built site in {html_dir}: run `make book` first", file=sys.stderr)
        return 1
    pages = [p for p in sb.html_pages(html_dir) if not sb.redirect_target(html_dir, p)]
    shutil.rmtree(out_dir, ignore_errors=True)
    started = time.perf_counter()
    for name, viewport in WIDTHS.items():
        def shoot(page, url, path, external, folder=out_dir / name):
            if not sb.open_page(page, url) and sb.page_has_math(html_dir / path):
                print(f"warning: {path}: MathJax did not run (an old build that loads it from a CDN?)")
            target = (folder / path).with_suffix(".png")
            target.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(target), full_page=True)
            return target

        try:
            shots = sb.visit_pages(html_dir, pages, shoot, viewport=viewport)
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 1
        print(f"{name}: {len(shots)} screenshots in {out_dir / name}")
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    args = [pathlib.Path(a) for a in sys.argv[1:3]]
    sys.exit(main(args[0] if args else ROOT / "_build" / "html",
                  args[1] if len(args) > 1 else ROOT / "_build" / "screenshots"))

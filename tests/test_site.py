"""The built site as readers see it: every page opened offline in headless Chromium.

One strict build (the `build` fixture in conftest.py) is served on 127.0.0.1 and every page is
loaded once in Debian's Chromium (tools/site_browser.py), with every request outside localhost
refused, as in a classroom without network. Each visit records what the tests below require of
every page: math typeset by the site's own MathJax with no error, every image loaded, no failed
local request, nothing fetched from outside, no console error, keyboard access to every
dropdown, no serious or critical axe-core violation (with the dropdowns open), and no sideways
scrolling at phone width. A crawl of the HTML files (no browser) checks every internal link and
anchor and the figures' alt text, and lists the external links for a human to check.
"""

from __future__ import annotations

import collections
import functools
import html.parser
import pathlib
import posixpath
import re
import time
import urllib.parse

import pytest
from axe_playwright_python.base import AXE_FILE_PATH  # the pinned package vendors axe.min.js

import site_browser as sb
import test_core_path_site as core_path
from conftest import timed

# the browser visits start with this file's first test (tests/conftest.py)
pytestmark = [pytest.mark.book, pytest.mark.usefixtures("site_visits_started")]

# --- in-page checks (JavaScript run by playwright) ---------------------------------------------

MATH_JS = r"""() => {
  const maths = [...document.querySelectorAll('span.math, div.math')];
  const untypeset = maths.filter(m => !m.querySelector('mjx-container'))
                         .map(m => m.textContent.trim().slice(0, 80));
  const errors = [...document.querySelectorAll('mjx-merror')]
                 .map(e => e.getAttribute('data-mjx-error') || e.textContent.slice(0, 80));
  // TeX delimiters left in the text are math MathJax never saw (code and outputs excepted).
  const skip = new Set(['SCRIPT', 'STYLE', 'PRE', 'CODE', 'TEXTAREA', 'NOSCRIPT', 'MJX-CONTAINER']);
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT, {acceptNode(node) {
    for (let el = node.parentElement; el; el = el.parentElement)
      if (skip.has(el.tagName)) return NodeFilter.FILTER_REJECT;
    return NodeFilter.FILTER_ACCEPT;
  }});
  const raw = [];
  while (walker.nextNode()) {
    const text = walker.currentNode.textContent;
    if (/\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{/.test(text)) raw.push(text.trim().slice(0, 120));
  }
  return {elements: maths.length, containers: document.querySelectorAll('mjx-container').length,
          untypeset, errors, raw};
}"""

IMAGES_JS = """() => [...document.images]
  .filter(img => !img.complete || img.naturalWidth === 0)
  .map(img => img.getAttribute('src'))"""

# Dropdowns a reader opens: sphinx-togglebutton's buttons (solutions, hidden cells) and any
# <details> summary. Each gets an id so that the Tab walk below can name it.
TOGGLES_JS = """() => [...document.querySelectorAll('button.toggle-button, details > summary')]
  .map((el, i) => { if (!el.id) el.id = `kbd-toggle-${i}`; return el.id; })"""

# Puts a focusable but untabbable mark just before the toggle `id` (before its <details> for a
# summary) and focuses it: the next Tab then goes to the first tabbable element after the mark,
# which is the toggle exactly when the toggle is in the page's Tab order.
TAB_START_JS = """id => { const el = document.getElementById(id);
  const mark = document.createElement('span');
  mark.id = 'kbd-tab-start'; mark.tabIndex = -1;
  (el.tagName === 'SUMMARY' ? el.parentElement : el).before(mark);
  mark.focus();
  return document.activeElement === mark; }"""

TAB_LANDED_JS = """() => { document.getElementById('kbd-tab-start').remove();
  const el = document.activeElement;
  return el && el !== document.body ? el.id || el.outerHTML.slice(0, 80) : null; }"""

FOCUS_RING_JS = """id => { const el = document.getElementById(id), style = getComputedStyle(el);
  return document.activeElement === el && el.matches(':focus-visible') &&
         (style.outlineStyle !== 'none' && parseFloat(style.outlineWidth) > 0 ||
          style.boxShadow !== 'none'); }"""

OPEN_STATE_JS = """id => { const el = document.getElementById(id);
  if (el.tagName === 'SUMMARY') return el.parentElement.open;
  const target = document.getElementById(el.dataset.target);
  return el.getAttribute('aria-expanded') === 'true' && !target.classList.contains('toggle-hidden'); }"""

# axe-core's two colour rules (color-contrast, link-in-text-block) cost most of a page's visit:
# before checking any element they lay out a grid of every element on the page, and a chapter
# has 15,000-30,000 of them, half written by MathJax and a third by the code highlighter. Yet
# a text's contrast follows from its style alone: its colour and size, and the backgrounds
# behind it. So `make test` audits contrast with TEXT_CONTRAST_JS, which takes every visible
# piece of text on the page, keeps one per distinct style, and computes WCAG AA's ratio (4.5:1,
# 3:1 for large text) over the backgrounds it sits on, in well under a second; every other axe
# rule runs on the whole page. `make check-release` runs axe's colour rules themselves on every
# page (test_axe_colour_rules_pass_on_every_page), which also look at what a style cannot show:
# text over an image or over another element. preload: false, because axe's own fetch of the
# style sheets resolves the theme's relative @import against the page instead of the style
# sheet, asking for a /basic.css that does not exist (only css-orientation-lock needs them).
#
# The audit fails on serious and critical violations only, and axe gives each violation its
# rule's impact (when it gathers a rule's results it sets every check's impact to the rule's),
# so a rule rated minor or moderate can never report what the audit looks for. Those rules,
# about a third of axe's, are left out: `region` alone, which finds content outside a landmark,
# took 4.8 s of a 6.3 s audit of chapter 8 (test_axe_skips_only_rules_that_cannot_fail_the_audit).
AXE_OPTIONS = "{preload: false, resultTypes: ['violations']}"
COLOUR_RULES = ("color-contrast", "link-in-text-block")
REPORTED_IMPACTS = ("serious", "critical")
# The rules rated below every impact in `reported` (rules without an impact are kept).
AXE_SKIPPED_JS = """reported => axe._audit.rules
  .filter(rule => rule.impact && !reported.includes(rule.impact)).map(rule => rule.id)"""
AXE_RUN_JS = """async rules => {
  // Let the dropdowns that keyboard_check opened finish fading in.
  await new Promise(resolve => requestAnimationFrame(resolve));
  await Promise.all(document.getAnimations()
    .filter(animation => animation.effect && animation.effect.getComputedTiming().endTime !== Infinity)
    .map(animation => animation.finished));
  const options = %s;
  // Math is left out of the colour rules: no formula sets a colour (tests/test_chapters.py),
  // so its text has the colour of the paragraph around it, which the rules check.
  const result = rules.only
    ? await axe.run({exclude: [['mjx-container']]}, {...options, runOnly: {type: 'rule', values: rules.only}})
    : await axe.run(document, {...options, rules: Object.fromEntries(rules.skip.concat(
        (%s)(rules.reported)).map(id => [id, {enabled: false}]))});
  return result.violations
    .filter(v => rules.reported.includes(v.impact))
    .map(v => ({id: v.id, impact: v.impact, help: v.help,
                nodes: v.nodes.slice(0, 5).map(n => n.target.join(' '))}));
}""" % (AXE_OPTIONS, AXE_SKIPPED_JS)

# Every distinct style of visible text on the page, with its contrast if below WCAG AA: the
# text's colour (its alpha times every ancestor's opacity) over the background colours behind
# it, composited up to the first opaque one (white if none is). Large text (24 px, or 18.66 px
# bold) needs 3:1, the rest 4.5:1, as in axe's color-contrast rule. A background image in the
# way cannot be judged from styles: the text is listed as unjudged, and check-release's axe
# run judges it from the pixels.
# What is behind an element, from styles alone: the colours of the backgrounds behind it,
# composited up to the first opaque one (white if none is), whether a background image is among
# them, and the product of its ancestors' opacities (TEXT_CONTRAST_JS, FIGURE_PIXELS_JS).
BACKDROP_JS = r"""
  const parse = css => {  // rgb()/rgba() as computed styles give them; null for anything else
    const m = css.match(/^rgba?\(([^)]+)\)$/);
    if (!m) return null;
    const p = m[1].split(/[\s,\/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const over = (top, below) => below.map((v, i) => i < 3 ? top[i] * top[3] + v * (1 - top[3]) : 1);
  const behind = new Map();  // element -> {colour: opaque rgb behind its content, image, opacity}
  const backdrop = el => {
    if (!el) return {colour: [255, 255, 255, 1], image: false, opacity: 1};
    if (behind.has(el)) return behind.get(el);
    const style = getComputedStyle(el), own = parse(style.backgroundColor) || [0, 0, 0, 0];
    const below = own[3] >= 1 ? {colour: own, image: false, opacity: 1} : backdrop(el.parentElement);
    const found = {colour: own[3] >= 1 ? own : over(own, below.colour),
                   image: below.image || style.backgroundImage !== 'none',
                   opacity: below.opacity * parseFloat(style.opacity)};
    behind.set(el, found);
    return found;
  };
"""

TEXT_CONTRAST_JS = r"""() => {""" + BACKDROP_JS + r"""
  const luminance = rgb => rgb.slice(0, 3).map(v => (v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4)
                              .reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);
  const styles = new Map(), done = new Set();
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT,
    {acceptNode: node => node.data.trim() ? NodeFilter.FILTER_ACCEPT : NodeFilter.FILTER_REJECT});
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const el = node.parentElement;
    if (!el || done.has(el)) continue;
    done.add(el);
    if (el.closest('mjx-assistive-mml') ||
        !el.checkVisibility({visibilityProperty: true, opacityProperty: true})) continue;
    const style = getComputedStyle(el), fg = parse(style.color);
    if (!fg) continue;
    const back = backdrop(el);
    const size = parseFloat(style.fontSize), bold = parseInt(style.fontWeight) >= 700;
    const large = size >= 24 || (size >= 18.66 && bold);
    const colour = over([...fg.slice(0, 3), fg[3] * back.opacity], back.colour);
    const key = `${colour.slice(0, 3).map(Math.round)} on ${back.colour.slice(0, 3).map(Math.round)}`
                + (large ? ' large' : '') + (back.image ? ' image' : '');
    if (styles.has(key)) continue;
    const [light, dark] = [luminance(colour), luminance(back.colour)].sort((a, b) => b - a);
    const name = el.tagName.toLowerCase() + (el.className && typeof el.className === 'string'
                 ? '.' + el.className.trim().split(/\s+/).join('.') : '');
    styles.set(key, {ratio: (light + 0.05) / (dark + 0.05), needs: large ? 3 : 4.5, image: back.image,
                     example: `${name} "${node.data.trim().slice(0, 30)}"`});
  }
  return {styles: styles.size,
          low: [...styles].filter(([, v]) => !v.image && v.ratio < v.needs)
            .map(([key, v]) => `${v.example}: rgb ${key}, ${v.ratio.toFixed(2)}:1 where ${v.needs}:1 is needed`),
          unjudged: [...styles].filter(([, v]) => v.image).map(([, v]) => v.example)};
}"""

# After a resize to phone width: nothing, or the outermost elements that stick out of the
# screen and how wide the page became.
PHONE_OVERFLOW_JS = """async () => {
  await new Promise(resolve => requestAnimationFrame(() => requestAnimationFrame(resolve)));
  const width = document.documentElement.clientWidth;
  if (document.documentElement.scrollWidth <= width) return [];
  const sticksOut = el => {
    if (!el.parentElement || el.closest('mjx-assistive-mml')) return false;  // clipped, unseen
    if (el.getBoundingClientRect().right <= width + 1) return false;
    for (let box = el; box; box = box.parentElement) {
      const style = getComputedStyle(box);
      if (style.position === 'fixed') return false;  // off-canvas drawers widen no page
      if (box !== el && style.overflowX !== 'visible')  // scrolled or clipped inside box
        return box.getBoundingClientRect().right > width + 1;
    }
    return true;
  };
  const culprits = new Set([...document.body.querySelectorAll('*')].filter(sticksOut));
  return [...culprits].filter(el => !culprits.has(el.parentElement)).slice(0, 5)  // outermost
    .map(el => `${el.tagName.toLowerCase()}.${String(el.className).split(' ')[0]} ends at ` +
               `${Math.round(el.getBoundingClientRect().right)} px: ` +
               el.textContent.replace(/\\s+/g, ' ').trim().slice(0, 60))
    .concat([`the page is ${document.documentElement.scrollWidth} px wide on a ${width} px screen`]);
}"""

# Display equations wider than the column they sit in, and for each whether the reader can
# scroll it (an ancestor with overflow-x auto or scroll) or it is cut off.
MATH_OVERFLOW_JS = """async () => {
  await new Promise(resolve => requestAnimationFrame(() => requestAnimationFrame(resolve)));
  const found = [];
  for (const box of document.querySelectorAll('div.math')) {
    const container = box.querySelector('mjx-container'), math = box.querySelector('mjx-container mjx-math');
    if (!math) continue;
    // The room is the equation's own box, beside its number, not the whole div.math.
    const wide = math.getBoundingClientRect().width, room = Math.min(box.clientWidth, container.clientWidth);
    if (wide <= room + 1) continue;
    let scroller = null;
    for (let el = math.parentElement; el && el !== document.body; el = el.parentElement) {
      const o = getComputedStyle(el).overflowX;
      if (o !== 'visible') { scroller = o; break; }
    }
    found.push({width: Math.round(wide), room: room,
                scrollable: scroller === 'auto' || scroller === 'scroll',
                text: box.textContent.replace(/\\s+/g, ' ').trim().slice(0, 70)});
  }
  return found;
}"""

# The page's chrome (header, sidebars, the article's button bar): every search control a reader
# can see, and every visible control of the chrome that something else covers. A control
# scrolled out of view inside its sidebar is not covered; one under a header is.
CHROME_JS = """async () => {
  await new Promise(resolve => requestAnimationFrame(() => requestAnimationFrame(resolve)));
  // A resize slides the sidebars in or out: wait until they have arrived.
  await Promise.all(document.getAnimations().map(animation => animation.finished.catch(() => null)));
  const shown = el => { const r = el.getBoundingClientRect(), s = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && s.visibility !== 'hidden' && !el.closest('dialog:not([open])'); };
  const name = el => `${el.tagName.toLowerCase()}.${String(el.className).split(' ')[0]}` +
    ` "${(el.getAttribute('aria-label') || el.textContent || el.placeholder || '').replace(/\\s+/g, ' ').trim().slice(0, 30)}"`;
  const chrome = '.bd-header, .bd-sidebar-primary, .bd-header-article, .bd-sidebar-secondary';
  // (search.html's own field is the page's content, not chrome)
  const searches = [...document.querySelectorAll(
    `:is(${chrome}) :is(input[type="search"], .search-button__button, button.search-button)`)]
    .filter(shown).map(name);
  const covered = [];
  for (const el of document.querySelectorAll(`:is(${chrome}) :is(a, button, input)`)) {
    if (!shown(el)) continue;
    const r = el.getBoundingClientRect(), x = r.left + r.width / 2, y = r.top + r.height / 2;
    if (x < 0 || y < 0 || x >= innerWidth || y >= innerHeight) continue;
    let inView = true;  // not scrolled out of a sidebar that clips it
    for (let box = el.parentElement; box && box !== document.body; box = box.parentElement) {
      if (getComputedStyle(box).overflowY === 'visible' && getComputedStyle(box).overflowX === 'visible') continue;
      const b = box.getBoundingClientRect();
      if (x < b.left || x > b.right || y < b.top || y > b.bottom) { inView = false; break; }
    }
    if (!inView) continue;
    const top = document.elementFromPoint(x, y);
    if (top && !el.contains(top) && !top.contains(el))
      covered.push(`${name(el)} at (${Math.round(x)}, ${Math.round(y)}) lies under ${name(top)}`);
  }
  return {searches, covered};
}"""

# --- explorable figures (code/explorable.py, _static/explorable.js) -----------------------------

ALL_DRAWN_JS = """() => [...document.querySelectorAll('div.explorable')]
  .every(d => d.classList.contains('explorable-ready') && d.querySelector('.explorable-live svg'))"""

# The native controls Vega wrote for one figure, each with the text of the label around it.
CONTROLS_JS = """id => [...document.getElementById(id).querySelectorAll(
    '.vega-bindings input, .vega-bindings select')].map((el, index) => ({
  index, tag: el.tagName.toLowerCase(), type: el.type,
  label: (el.closest('label') ? el.closest('label').textContent : '').trim(),
  // at its last value, where the first of STEP_KEYS would change nothing
  atEnd: el.type === 'range' ? Number(el.value) >= Number(el.max)
         : el.tagName === 'SELECT' && el.selectedIndex === el.options.length - 1,
}))"""

CHART_JS = "id => document.getElementById(id).querySelector('.explorable-live svg').outerHTML"

# On screen the live chart shows and the still image does not; in print, the other way round.
SHOWN_JS = """() => [...document.querySelectorAll('div.explorable')].map(d => {
  const shown = el => Boolean(el) && getComputedStyle(el).display !== 'none' &&
                      el.getBoundingClientRect().width > 0;
  const still = d.querySelector('img.explorable-still');
  return {id: d.id, still: shown(still) && still.naturalWidth > 0,
          live: shown(d.querySelector('.explorable-live'))};
})"""

# Keys that move a control one step: a slider right (left when it starts at its maximum), a
# drop-down to its next option (its previous one from the last), a check box or radio button
# toggled. A control at its end (CONTROLS_JS's atEnd) takes the second key first.
STEP_KEYS = {"range": ["ArrowRight", "ArrowLeft"], "select-one": ["ArrowDown", "ArrowUp"],
             "checkbox": ["Space"], "radio": ["ArrowRight", "ArrowLeft"]}


def wait_until_drawn(page) -> None:
    """Scroll to every explorable figure of the page, as a reader does (the Vega bundle loads
    when a figure comes near the screen), then wait (up to 20 s) until each is drawn; a figure
    that is not is reported by the caller, per figure."""
    page.evaluate("() => document.querySelectorAll('div.explorable')"
                  ".forEach(d => d.scrollIntoView({block: 'center'}))")
    try:
        page.wait_for_function(ALL_DRAWN_JS, timeout=20_000)
    except Exception:  # playwright's TimeoutError
        pass


def explorable_check(page) -> list[dict]:
    """Wait until every explorable figure is drawn; then move each of its controls by keyboard
    and record whether the chart changed. Also records what shows on screen and in print."""
    ids = page.evaluate("() => [...document.querySelectorAll('div.explorable')].map(d => d.id)")
    if not ids:
        return []
    wait_until_drawn(page)
    screen = {f["id"]: f for f in page.evaluate(SHOWN_JS)}
    page.emulate_media(media="print")
    printed = {f["id"]: f for f in page.evaluate(SHOWN_JS)}
    page.emulate_media(media="screen")
    figures = []
    for fig in ids:
        problems = []
        if not page.evaluate(f"() => Boolean(document.querySelector('#{fig} .explorable-live svg'))"):
            figures.append({"id": fig, "controls": 0, "problems": ["never drawn"]})
            continue
        if not (screen[fig]["live"] and not screen[fig]["still"]):
            problems.append(f"on screen: {screen[fig]}")
        if not (printed[fig]["still"] and not printed[fig]["live"]):
            problems.append(f"in print: {printed[fig]}")
        controls = page.evaluate(CONTROLS_JS, fig)
        if not controls:
            problems.append("no native control")
        for control in controls:
            name = control["label"] or f"{control['tag']} {control['index']}"
            if not control["label"]:
                problems.append(f"{name}: no label")
            element = page.locator(f"#{fig} .vega-bindings").locator("input, select").nth(
                control["index"])
            changed = False
            keys = STEP_KEYS.get(control["type"], [])
            for key in keys[::-1] if control["atEnd"] else keys:  # the step that can change it
                before = page.evaluate(CHART_JS, fig)
                element.focus()
                page.keyboard.press(key)
                try:
                    page.wait_for_function(f"before => ({CHART_JS})({fig!r}) !== before", arg=before,
                                           timeout=3_000)
                    changed = True
                    break
                except Exception:
                    continue
            if not changed:
                problems.append(f"{name} ({control['type']}): the chart did not change when "
                                "it was moved by keyboard")
        figures.append({"id": fig, "controls": len(controls), "problems": problems})
    return figures


# The figures of a page, as images: each <figure>'s <img> or drawn explorable chart.
FIGURE_ELEMENTS = "figure img:not(.explorable-still), figure .explorable-live svg.marks"


def _luminance(rgb) -> float:
    channels = [c / 255 for c in rgb]
    r, g, b = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def readable(png: bytes) -> tuple[bool, str]:
    """Whether a figure, as drawn on the page, has marks that stand out from its background:
    at least 0.3% of its pixels at 3:1 contrast or more (WCAG's ratio for graphics) against its
    most common colour. A figure with a transparent background and black text on a dark page
    has none."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    colours = image.getcolors(maxcolors=image.width * image.height)
    total = image.width * image.height
    background = max(colours)[1]
    lb = _luminance(background)
    contrasting = sum(n for n, rgb in colours
                      if (max(lb, _luminance(rgb)) + 0.05) / (min(lb, _luminance(rgb)) + 0.05) >= 3)
    share = contrasting / total
    return share >= 0.003, f"background {background}, {share:.2%} of pixels at 3:1 or more"


# Each figure of FIGURE_ELEMENTS as drawn on the page, in page order: an <img> is painted into a
# canvas of its size over the backdrop behind it (BACKDROP_JS), with its own background, filter
# and opacity as the page gives them, and returned as a PNG (data: URL). What styles alone cannot
# show is left to a screenshot (null): a drawn chart (inline SVG, styled by the page's CSS), an
# image over a background image or blended into what is below it, an image not laid out.
# Painting took about a tenth of a screenshot's time (2.6 s against 20 s for the book's 69
# images), which must scroll to the figure and paint the page around it. On every page of the
# book, in both themes, the two gave the same verdicts (readable) and shares of contrasting
# pixels within 7 points of each other; test_a_painted_figure_reads_as_its_screenshot compares
# them on figures made to fail.
FIGURE_PIXELS_JS = r"""async selector => {""" + BACKDROP_JS + r"""
  const drawn = [];
  for (const el of document.querySelectorAll(selector)) {
    const style = getComputedStyle(el), back = backdrop(el.parentElement);
    if (el.tagName !== 'IMG' || back.image || style.mixBlendMode !== 'normal' ||
        !el.clientWidth || !el.clientHeight) {  // (not laid out: the screenshot says why)
      drawn.push(null);
      continue;
    }
    await el.decode();
    const canvas = document.createElement('canvas');
    canvas.width = el.clientWidth;
    canvas.height = el.clientHeight;
    const ctx = canvas.getContext('2d');
    ctx.fillStyle = `rgb(${back.colour.slice(0, 3).join(',')})`;
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.globalAlpha = back.opacity * parseFloat(style.opacity);
    ctx.fillStyle = style.backgroundColor;
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.filter = style.filter;
    ctx.drawImage(el, 0, 0, canvas.width, canvas.height);
    drawn.push(canvas.toDataURL('image/png'));
  }
  return drawn;
}"""


def figure_pngs(page) -> list[bytes]:
    """Each figure of the page (FIGURE_ELEMENTS) as a PNG of what it shows: painted
    (FIGURE_PIXELS_JS), or a screenshot where styles cannot tell."""
    import base64

    figures = page.locator(FIGURE_ELEMENTS)
    return [base64.b64decode(url.split(",", 1)[1]) if url else figures.nth(index).screenshot()
            for index, url in enumerate(page.evaluate(FIGURE_PIXELS_JS, FIGURE_ELEMENTS))]


def figure_contrast(page) -> list[str]:
    """Problems with the figures' legibility in the page's current theme."""
    problems = []
    figures = page.locator(FIGURE_ELEMENTS)
    for index, png in enumerate(figure_pngs(page)):
        element = figures.nth(index)
        ok, how = readable(png)
        if not ok:
            src = element.get_attribute("src") or element.evaluate(
                "e => e.closest('div.explorable').id")
            problems.append(f"figure {index + 1} ({src}): {how}")
    return problems


WIDE = {"width": 1600, "height": 900}  # a wide screen, where the theme shows more chrome

def keyboard_check(page) -> dict:
    """For every dropdown toggle, in page order: Tab from just before it must land on it (it is
    in the Tab order), show a focus ring and open with Enter. The page's first toggle of each
    kind (sphinx-togglebutton's button, a <details>' summary) also closes with Enter and opens
    with Space: the others of its kind answer the keys with the same code, and each opening or
    closing lays a long page out again. Leaves every dropdown open, so that the accessibility
    audit sees the solutions too."""
    toggles = page.evaluate(TOGGLES_JS)
    unreachable, problems, kinds = [], [], {}  # kinds: tag -> the toggle given every key
    for toggle in toggles:
        if not page.evaluate(TAB_START_JS, toggle):
            unreachable.append(toggle)  # not rendered: its container is closed or hidden
            continue
        page.keyboard.press("Tab")
        landed = page.evaluate(TAB_LANDED_JS)
        if landed != toggle:
            problems.append(f"{toggle}: Tab from just before it lands on {landed}")
            continue
        if not page.evaluate(FOCUS_RING_JS, toggle):
            problems.append(f"{toggle}: no visible focus ring")
        kind = page.evaluate("id => document.getElementById(id).tagName", toggle)
        keys = ("Enter",) if kind in kinds else ("Enter", "Enter", "Space")
        kinds.setdefault(kind, toggle)
        states = []
        for key in keys:
            page.keyboard.press(key)
            states.append(page.evaluate(OPEN_STATE_JS, toggle))
        if states != [True, False, True][:len(keys)]:
            problems.append(f"{toggle}: open after {', '.join(keys)} = {states}")
    return {"toggles": len(toggles), "unreachable": unreachable, "problems": problems,
            "every_key": kinds}


# What the page loaded: its own address and every resource's, once MathJax has typeset it.
LOADED_JS = "() => [location.href, ...performance.getEntriesByType('resource').map(e => e.name)]"
PAGE_BUDGET = 600 * 1024  # gzip bytes of a chapter page and everything it loads, fonts aside
FONTS = (".woff", ".woff2", ".ttf")


@functools.lru_cache(maxsize=None)
def gzip_size(path: pathlib.Path) -> int:
    """The bytes of the file as a server sends it compressed (gzip at its default level 6)."""
    import gzip
    return len(gzip.compress(path.read_bytes(), compresslevel=6))


def page_weight(html_dir: pathlib.Path, urls: list[str]) -> tuple[int, int, list]:
    """(gzip bytes of everything but fonts, gzip bytes of fonts, the five largest files) of
    the site's files behind ``urls``, each file counted once."""
    files = set()
    for url in urls:
        path = html_dir / urllib.parse.unquote(urllib.parse.urlparse(url).path.lstrip("/"))
        if path.is_file():
            files.add(path)
    sizes = {path: gzip_size(path) for path in files}
    rest = {path: size for path, size in sizes.items() if path.suffix not in FONTS}
    largest = sorted(((size, path.relative_to(html_dir).as_posix())
                      for path, size in rest.items()), reverse=True)[:5]
    return sum(rest.values()), sum(sizes.values()) - sum(rest.values()), largest


def visit(page, url: str, path: str, external: list, html_dir: pathlib.Path, axe_script: str) -> dict:
    """Open one page and record everything the tests check."""
    report = collections.defaultdict(list)
    page.on("console", lambda msg: msg.type == "error" and report["console_errors"].append(msg.text))
    page.on("pageerror", lambda err: report["console_errors"].append(f"uncaught: {err}"))
    page.on("requestfailed", lambda req: sb.is_local(req.url) and report["failed_requests"].append(
        f"{req.url}: {req.failure}"))
    page.on("response", lambda resp: resp.status >= 400 and sb.is_local(resp.url) and
            report["failed_requests"].append(f"{resp.url}: HTTP {resp.status}"))
    report["external_requests"] = external  # filled in by the offline route as the page loads
    started = time.perf_counter()
    if target := sb.redirect_target(html_dir, path):
        # A redirect only: it must land on its target page, which is visited on its own.
        page.goto(url)
        page.wait_for_url(url[: -len(path)] + target, timeout=10_000)
        return {**report, "redirect": target, "seconds": time.perf_counter() - started}
    report["mathjax_ran"] = sb.open_page(page, url)
    report["loaded"] = page.evaluate(LOADED_JS)  # before anything scrolls or opens
    report["math"] = page.evaluate(MATH_JS)
    report["broken_images"] = page.evaluate(IMAGES_JS)
    report["keyboard"] = keyboard_check(page)
    report["explorables"] = explorable_check(page)  # drawn before axe audits the page
    report["figure_contrast"] = figure_contrast(page)
    page.evaluate(axe_script)
    report["axe"] = page.evaluate(AXE_RUN_JS, {"skip": COLOUR_RULES, "reported": REPORTED_IMPACTS})
    report["text_contrast"] = page.evaluate(TEXT_CONTRAST_JS)
    report["math_overflow_desktop"] = page.evaluate(MATH_OVERFLOW_JS)
    page.evaluate("() => scrollTo(0, 0)")
    report["chrome"] = {sb.DESKTOP["width"]: page.evaluate(CHROME_JS)}
    # The core path's switch, at desktop width, where the page is laid out already; on the page
    # whose check opens another chapter, last (laying a chapter out at a new width costs about
    # half a second).
    chapter = path in core_path.chapter_pages(html_dir)
    if chapter and path != core_path.SWITCH_ACROSS_PAGES:
        report["core_switch"] = core_path.switch_check(
            page, url, path, printed=path == core_path.PRINTED_IN_TEST)
    page.set_viewport_size(WIDE)
    report["chrome"][WIDE["width"]] = page.evaluate(CHROME_JS)
    # Then as a phone: nothing may make the page wider than the screen.
    page.set_viewport_size(sb.PHONE)
    report["phone_overflow"] = page.evaluate(PHONE_OVERFLOW_JS)
    report["math_overflow_phone"] = page.evaluate(MATH_OVERFLOW_JS)
    page.evaluate("() => scrollTo(0, 0)")
    report["chrome"][sb.PHONE["width"]] = page.evaluate(CHROME_JS)
    if chapter and path == core_path.SWITCH_ACROSS_PAGES:
        page.set_viewport_size(sb.DESKTOP)
        report["core_switch"] = core_path.switch_check(
            page, url, path, printed=path == core_path.PRINTED_IN_TEST)
    report["seconds"] = time.perf_counter() - started
    return dict(report)


def visit_site(build):
    """(html_dir, {page: report}) for every page of the built site, each page opened once for
    every audit: the `site` fixture of conftest.py, shared by this file and
    test_core_path_site.py."""
    _, _, out = build
    html_dir = out / "html"
    pages = sb.html_pages(html_dir)
    assert pages, f"no HTML pages in {html_dir}"
    axe_script = AXE_FILE_PATH.read_text(encoding="utf-8")
    started = time.perf_counter()
    try:
        reports = sb.visit_pages(html_dir, pages, functools.partial(
            visit, html_dir=html_dir, axe_script=axe_script))
    except RuntimeError as err:
        if "make browser" in str(err):  # no Chromium recorded: say how to get one
            pytest.fail(str(err), pytrace=False)
        raise
    print(f"\nbrowser visits: {len(pages)} pages in {time.perf_counter() - started:.1f} s; slowest: "
          + ", ".join(f"{p} {r['seconds']:.1f} s" for p, r in
                      sorted(reports.items(), key=lambda kv: -kv[1]["seconds"])[:3]))
    return html_dir, reports


def pages_with(html_dir: pathlib.Path, marker: str) -> list[str]:
    return [p for p in sb.html_pages(html_dir) if marker in (html_dir / p).read_text()]


def visit_dark(page, url: str, path: str, external: list, html_dir: pathlib.Path) -> dict:
    """The page in the theme's dark mode (the reader's system asks for it): the figures, and
    on a chapter the core path's switch."""
    sb.open_page(page, url)
    report = {"theme": page.evaluate("() => document.documentElement.dataset.theme")}
    report["explorables"] = page.evaluate("() => document.querySelectorAll('div.explorable').length")
    if report["explorables"]:
        wait_until_drawn(page)
        report["chart_backgrounds"] = page.evaluate(
            "() => [...document.querySelectorAll('.explorable-live svg.marks')]"
            ".map(svg => getComputedStyle(svg).backgroundColor)")
    report["figure_contrast"] = figure_contrast(page)
    if path in core_path.chapter_pages(html_dir):
        report["core_switch"] = core_path.switch_check(page, url, path)
    return report


def visit_for_colours(page, url: str, path: str, external: list, html_dir: pathlib.Path,
                      axe_script: str) -> list:
    """axe-core's own colour rules on the page, every dropdown open (`make check-release`)."""
    if sb.redirect_target(html_dir, path):
        return []
    sb.open_page(page, url)
    keyboard_check(page)
    page.evaluate(axe_script)
    return page.evaluate(AXE_RUN_JS, {"only": COLOUR_RULES, "reported": REPORTED_IMPACTS})


@pytest.fixture(scope="module")
def dark_site(build):
    """{page: report} for every page with a figure and every chapter, opened in dark mode
    (`make check-release` only: `make test` looks at one theme)."""
    _, _, out = build
    html_dir = out / "html"
    pages = sorted(set(pages_with(html_dir, "<figure")) | set(core_path.chapter_pages(html_dir)))
    return sb.visit_pages(html_dir, pages, functools.partial(visit_dark, html_dir=html_dir),
                          color_scheme="dark")


def visit_without_javascript(page, url: str, path: str, external: list) -> dict:
    page.goto(url, wait_until="load")
    return {"explorables": page.evaluate(SHOWN_JS),
            "alts": page.evaluate("() => [...document.querySelectorAll('img.explorable-still')]"
                                  ".map(img => img.alt)")}


@pytest.fixture(scope="module")
def no_script_site(build):
    """{page: report} for every page with an explorable figure, with JavaScript off."""
    _, _, out = build
    html_dir = out / "html"
    return sb.visit_pages(html_dir, pages_with(html_dir, 'class="explorable"'),
                          visit_without_javascript, java_script_enabled=False)


def failures(reports: dict, check, redirects: bool = False) -> dict:
    """{page: problems} for the pages where check(page, report) returns something; pages that
    only redirect are left out unless `redirects`."""
    found = {page: check(page, report) for page, report in reports.items()
             if redirects or "redirect" not in report}
    return {page: problems for page, problems in found.items() if problems}


def format_failures(found: dict) -> str:
    return "\n".join(f"{page}:\n  " + "\n  ".join(map(str, problems)) for page, problems in found.items())


# --- the tests -----------------------------------------------------------------------------------

def test_a_chromium_was_found_or_installed():
    assert sb.chromium.recorded()  # raises, saying how to get one, when there is none


def test_math_is_typeset_offline_without_errors(site):
    html_dir, reports = site

    def check(page, report):
        math = report["math"]
        problems = []
        if sb.page_has_math(html_dir / page):
            if not report["mathjax_ran"]:
                problems.append("the page has math but MathJax did not run (not shipped with the site?)")
            if math["containers"] == 0:
                problems.append("no mjx-container: nothing was typeset")
        if math["untypeset"]:
            problems.append(f"{len(math['untypeset'])} of {math['elements']} formulas not typeset, "
                            f"e.g. {math['untypeset'][:3]}")
        problems += [f"MathJax error: {e}" for e in math["errors"]]
        if math["raw"]:
            problems.append(f"raw TeX left in the text, {len(math['raw'])} times, e.g. {math['raw'][:3]}")
        return problems

    found = failures(reports, check)
    assert not found, "math problems:\n" + format_failures(found)
    assert any(r.get("math", {}).get("containers") for r in reports.values()), "no page typeset any math"


def test_a_chapter_page_loads_at_most_600_kb(site):
    """Every chapter page, with the HTML, scripts, styles and images it loads, weighs at most
    600 KB gzip (fonts are counted apart: the theme's icon font and MathJax's, which the browser
    caches after the first page). The theme's Font Awesome script and the search index are not
    loaded (_ext/html_fixes.py); the Vega bundle is loaded only when a figure comes near the
    screen (_static/explorable.js), not with the page."""
    html_dir, reports = site
    weights = {page: page_weight(html_dir, report["loaded"])
               for page, report in reports.items() if page in core_path.chapter_pages(html_dir)}
    assert len(weights) >= 13, sorted(weights)
    heavy = {page: f"{rest / 1024:.0f} KB gzip (fonts {fonts / 1024:.0f} KB apart); largest: "
             + ", ".join(f"{name} {size / 1024:.0f} KB" for size, name in largest)
             for page, (rest, fonts, largest) in weights.items() if rest > PAGE_BUDGET}
    assert not heavy, "pages over 600 KB:\n" + "\n".join(f"{p}: {w}" for p, w in heavy.items())
    loaded = {name for report in reports.values() for name in report.get("loaded", [])}
    assert not [u for u in loaded if "fontawesome.js" in u or "vega-bundle" in u], (
        "a page loads Font Awesome's script, or the Vega bundle before any figure is near")


def test_every_image_loads(site):
    _, reports = site
    found = failures(reports, lambda page, r: [f"image not loaded: {src}" for src in r["broken_images"]])
    assert not found, format_failures(found)


def test_no_failed_or_external_request(site):
    _, reports = site
    found = failures(reports, lambda page, r: r.get("failed_requests", []) + [
        f"needs the network: {url}" for url in r["external_requests"]], redirects=True)
    assert not found, format_failures(found)


def test_no_console_error(site):
    _, reports = site
    found = failures(reports, lambda page, r: r.get("console_errors", []), redirects=True)
    assert not found, format_failures(found)


def test_no_serious_or_critical_accessibility_violation(site):
    _, reports = site
    found = failures(reports, lambda page, r: [
        f"{v['impact']} {v['id']}: {v['help']}" + (f" at {v['nodes']}" if v["nodes"] else "")
        for v in r["axe"]] + [f"text below WCAG AA contrast: {low}" for low in r["text_contrast"]["low"]])
    assert not found, "axe-core violations and faint text:\n" + format_failures(found)
    judged = [r["text_contrast"]["styles"] for r in reports.values() if "redirect" not in r]
    assert min(judged) > 0, "a page where TEXT_CONTRAST_JS found no text at all"


@pytest.mark.release
def test_axe_colour_rules_pass_on_every_page(build):
    """What `make test` judges from styles (TEXT_CONTRAST_JS), axe-core judges here from the
    page itself, element by element: contrast over images and other elements included."""
    _, _, out = build
    html_dir = out / "html"
    reports = sb.visit_pages(html_dir, sb.html_pages(html_dir), functools.partial(
        visit_for_colours, html_dir=html_dir, axe_script=AXE_FILE_PATH.read_text(encoding="utf-8")))
    found = {page: [f"{v['impact']} {v['id']}: {v['help']} at {v['nodes']}" for v in violations]
             for page, violations in reports.items() if violations}
    assert not found, "axe-core colour violations:\n" + format_failures(found)


def test_text_contrast_finds_faint_text_of_every_kind(tmp_path):
    """TEXT_CONTRAST_JS on a page made for it: each faint style is found, once, and nothing else;
    text over a gradient is listed as unjudged; hidden text is not looked at."""
    (tmp_path / "index.html").write_text("""<!DOCTYPE html><html lang="en"><head><title>t</title></head>
<body style="font-size:16px">
<p>Black on white, and <span style="color:#999">grey on white (2.85:1)</span>.</p>
<p>Also <span style="color:#999">grey again, the same style</span>.</p>
<p style="font-size:24px;color:#888">Large grey text (3.54:1) passes</p>
<p style="font-size:16px;color:#888">The same grey, small, fails</p>
<pre style="background:#f8f8f8"><span style="color:#777">token</span> <span style="color:#000">x</span></pre>
<p style="color:rgba(0,0,0,0.3)">Black at 30 % alpha</p>
<div style="opacity:0.5"><p style="color:#555">#555 in a half-transparent block</p></div>
<div style="background:rgba(0,0,0,0.85)"><p style="color:#fff">white on a dark translucent layer</p></div>
<p style="background-image:linear-gradient(#fff,#000);color:#777">over a gradient</p>
<p style="display:none;color:#eee">hidden</p>
</body></html>""")
    found = sb.visit_pages(tmp_path, ["index.html"],
                           lambda page, url, path, external: (page.goto(url), page.evaluate(TEXT_CONTRAST_JS))[1])
    result = found["index.html"]
    low = sorted(problem.split('": ')[0] + '"' for problem in result["low"])
    assert low == ['p "#555 in a half-transparent blo"', 'p "Black at 30 % alpha"', 'p "The same grey, small, fails"',
                   'span "grey on white (2.85:1)"', 'span "token"'], result["low"]
    assert result["unjudged"] == ['p "over a gradient"'], result


FIGURE_SVG = """<svg xmlns="http://www.w3.org/2000/svg" width="200" height="100">%s
<rect x="20" y="20" width="60" height="60" fill="#000"/>
<text x="100" y="60" font-size="20">x</text></svg>"""


def test_a_painted_figure_reads_as_its_screenshot(tmp_path):
    """figure_pngs paints each image (FIGURE_PIXELS_JS) or takes a screenshot where styles cannot
    tell: on figures made to read or not (a transparent image on a dark page, alone, with a
    background of its own, under a filter, in a faint block, over a gradient), readable gives
    the painting the screenshot's verdict, and figure_contrast names exactly the ones that do
    not read."""
    (tmp_path / "clear.svg").write_text(FIGURE_SVG % "")
    (tmp_path / "white.svg").write_text(
        FIGURE_SVG % '<rect width="200" height="100" fill="#fff"/>')
    figure = '<figure><img src="{}" alt="a figure" style="{}"></figure>'
    cases = {  # (image, the img's style, its container's style): does it read?
        "on white": ("white.svg", "", "", True),
        "transparent on dark": ("clear.svg", "", "background:#111", False),
        "given a background": ("clear.svg", "background:#fff", "background:#111", True),
        "darkened to black": ("white.svg", "filter:brightness(0)", "", False),
        "in a faint block": ("clear.svg", "", "opacity:0.08", False),
        "over a gradient": ("white.svg", "", "background-image:linear-gradient(#fff,#000)", True),
    }
    (tmp_path / "index.html").write_text(
        '<!DOCTYPE html><html lang="en"><head><title>t</title></head><body>' + "".join(
            f'<div style="{box}">{figure.format(image, style)}</div>'
            for image, style, box, _ in cases.values()) + "</body></html>")

    def look(page, url, path, external):
        page.goto(url)
        painted = page.evaluate(FIGURE_PIXELS_JS, FIGURE_ELEMENTS)
        figures = page.locator(FIGURE_ELEMENTS)
        shots = [figures.nth(i).screenshot() for i in range(figures.count())]
        return painted, [readable(png)[0] for png in figure_pngs(page)], \
            [readable(png)[0] for png in shots], figure_contrast(page)

    painted, verdicts, screenshots, problems = sb.visit_pages(
        tmp_path, ["index.html"], look)["index.html"]
    assert [url is None for url in painted] == [name == "over a gradient" for name in cases]
    expected = [reads for *_, reads in cases.values()]
    assert verdicts == screenshots == expected, (verdicts, screenshots)
    assert [int(p.split()[1]) for p in problems] == [
        i + 1 for i, (*_, reads) in enumerate(cases.values()) if not reads], problems


AXE_FULL_RUN_JS = """async () => (await axe.run(document, %s)).violations.map(v => [v.id, v.impact])""" % AXE_OPTIONS


def test_axe_skips_only_rules_that_cannot_fail_the_audit(tmp_path):
    """On a page with a critical violation (an image without alt text) beside moderate and minor
    ones (text outside any landmark, a heading level skipped, an empty heading), the audit
    (AXE_RUN_JS) reports what axe's full run reports at serious or critical impact, and every
    rule it leaves out reports at minor or moderate impact only."""
    (tmp_path / "index.html").write_text("""<!DOCTYPE html><html lang="en"><head><title>t</title></head>
<body><p>Outside every landmark.</p><main><h1>Title</h1><h4>Level 4 after 1</h4><h2></h2>
<img src="data:image/gif;base64,R0lGODlhAQABAAAAACw=" width="20" height="20"></main></body></html>""")
    axe_script = AXE_FILE_PATH.read_text(encoding="utf-8")

    def audit(page, url, path, external):
        page.goto(url)
        page.evaluate(axe_script)
        return {"audit": page.evaluate(AXE_RUN_JS, {"skip": COLOUR_RULES, "reported": REPORTED_IMPACTS}),
                "full": page.evaluate(AXE_FULL_RUN_JS),
                "skipped": page.evaluate(AXE_SKIPPED_JS, REPORTED_IMPACTS)}

    found = sb.visit_pages(tmp_path, ["index.html"], audit)["index.html"]
    full = dict(found["full"])
    assert {"image-alt", "region", "heading-order", "empty-heading"} <= set(full), full
    assert "region" in found["skipped"] and "image-alt" not in found["skipped"], found["skipped"]
    assert sorted(v["id"] for v in found["audit"]) == sorted(
        rule for rule, impact in full.items() if impact in REPORTED_IMPACTS), found
    assert all(full[rule] in ("minor", "moderate") for rule in found["skipped"] if rule in full), full


def test_keyboard_reaches_and_opens_every_dropdown(site):
    _, reports = site
    with_toggles = {p: r["keyboard"] for p, r in reports.items()
                    if "redirect" not in r and r["keyboard"]["toggles"]}
    chapters_with_solutions = [p for p in reports if "solution dropdown" in
                               (site[0] / p).read_text(encoding="utf-8")]
    assert set(chapters_with_solutions) <= set(with_toggles), "solution dropdowns without a toggle button"
    found = failures(with_toggles, lambda page, k: [f"Tab never reaches {t}" for t in k["unreachable"]]
                     + k["problems"])
    assert not found, format_failures(found)
    # every key on both kinds of toggle, somewhere
    assert {kind for k in with_toggles.values() for kind in k["every_key"]} == {
        "BUTTON", "SUMMARY"}, {p: k["every_key"] for p, k in with_toggles.items()}


def test_every_display_equation_fits_its_column_at_desktop_width(site):
    _, reports = site
    found = failures(reports, lambda page, r: [
        f"{m['width']} px in a {m['room']} px column: {m['text']}"
        for m in r.get("math_overflow_desktop", [])])
    assert not found, (f"display equations wider than their column at "
                       f"{sb.DESKTOP['width']} px:\n" + format_failures(found))


def test_display_equations_too_wide_for_a_phone_scroll_and_are_never_cut_off(site):
    _, reports = site
    wide = {page: r.get("math_overflow_phone", []) for page, r in reports.items()}
    print(f"\ndisplay equations wider than a {sb.PHONE['width']} px phone: "
          f"{sum(map(len, wide.values()))}")
    found = failures(reports, lambda page, r: [
        f"cut off: {m['text']}" for m in r.get("math_overflow_phone", [])
        if not m["scrollable"]])
    assert not found, "display equations cut off at phone width:\n" + format_failures(found)


def test_one_search_field_and_no_page_chrome_under_other_chrome_at_every_width(site):
    _, reports = site

    def check(page, report):
        problems = []
        for width, chrome in report["chrome"].items():
            if len(chrome["searches"]) != 1:
                problems.append(f"{width} px: {len(chrome['searches'])} search controls shown: "
                                f"{chrome['searches']}")
            problems += [f"{width} px: {c}" for c in chrome["covered"]]
        return problems

    found = failures(reports, check)
    assert not found, "page chrome:\n" + format_failures(found)


def test_no_page_scrolls_sideways_on_a_phone(site):
    _, reports = site
    found = failures(reports, lambda page, r: r["phone_overflow"])
    assert not found, f"wider than a {sb.PHONE['width']} px phone:\n" + format_failures(found)


# --- link integrity (a crawl of the files, no browser) -------------------------------------------

class _LinksAndIds(html.parser.HTMLParser):
    LINK_ATTRS = {"a": "href", "link": "href", "area": "href", "img": "src", "script": "src",
                  "iframe": "src", "source": "src", "video": "src", "audio": "src"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.ids: set[str] = set()
        self.images: list[tuple[str, str | None]] = []  # (src, alt)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        if tag == "img":
            self.images.append((attrs.get("src") or "", attrs.get("alt")))
        url = attrs.get(self.LINK_ATTRS.get(tag, ""))
        if tag == "meta" and (attrs.get("http-equiv") or "").lower() == "refresh":
            url = (attrs.get("content") or "").partition("url=")[2]
        if url:
            self.links.append(url.strip())


def parse_html(path: pathlib.Path) -> _LinksAndIds:
    parser = _LinksAndIds()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def crawl(html_dir: pathlib.Path) -> tuple[list[str], dict[str, set[str]]]:
    """(broken internal links, {external URL: pages linking it}) over every page of the site."""
    parsed = {page: parse_html(html_dir / page) for page in sb.html_pages(html_dir)}
    broken, external = [], collections.defaultdict(set)
    for page, doc in parsed.items():
        for url in doc.links:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme in {"http", "https"} or url.startswith("//"):
                external[url].add(page)
                continue
            if parts.scheme:  # mailto:, javascript:, data:
                continue
            target = page
            if parts.path:
                target = posixpath.normpath(posixpath.join(posixpath.dirname(page),
                                                           urllib.parse.unquote(parts.path)))
            if parts.path.endswith("/") or (html_dir / target).is_dir():
                target = posixpath.join(target, "index.html")
            if target.startswith("..") or not (html_dir / target).is_file():
                broken.append(f"{page}: {url} (no file {target})")
                continue
            fragment = urllib.parse.unquote(parts.fragment)
            if fragment and target.endswith(".html"):
                ids = parsed[target].ids if target in parsed else parse_html(html_dir / target).ids
                if fragment not in ids:
                    broken.append(f"{page}: {url} (no id {fragment!r} in {target})")
    return broken, external


def test_every_figure_has_alt_text_that_describes_it(build):
    """Figures (the images in _images/) need alt text that says what they show: at least a few
    words, and not the file name that myst-nb puts there when a cell sets none."""
    _, _, out = build
    html_dir = out / "html"
    missing = []
    for page in sb.html_pages(html_dir):
        for src, alt in parse_html(html_dir / page).images:
            if "_images/" not in src:
                continue
            words = (alt or "").split()
            if len(words) < 3 or re.search(r"\.(svg|png|jpe?g|gif)$", alt.strip(), re.IGNORECASE):
                missing.append(f"{page}: {src} has alt {alt!r}")
    assert not missing, "figures without a description:\n" + "\n".join(missing)


def test_internal_links_and_anchors_resolve_and_external_links_are_listed(build):
    _, _, out = build
    broken, external = crawl(out / "html")
    report = out / "external-links.txt"
    report.write_text(
        "# External links of the built site, to check by hand when a network exists.\n"
        "# URL <tab> pages that link it\n"
        + "".join(f"{url}\t{' '.join(sorted(pages))}\n" for url, pages in sorted(external.items())),
        encoding="utf-8")
    print(f"\n{len(external)} external links listed in {report}")
    assert not broken, f"{len(broken)} broken internal links:\n" + "\n".join(broken)


# --- the book as one PDF (`make pdf`) ------------------------------------------------------------


def printed_book(html_dir: pathlib.Path, target: pathlib.Path, core: bool,
                 pages: list[str] | None = None) -> tuple[dict, str]:
    """Print the book (or only `pages`) with tools/pdf.py and check it as a book: every page's
    title in the contents, in the order of _toc.yml and at the page the contents give, no "??"
    of an unresolved reference, an outline that lists the pages. Returns the contents
    ({page: (title, first page)}) and the PDF's text."""
    import pdf
    from pypdf import PdfReader

    contents = pdf.print_book(html_dir, target, core=core, pages=pages)
    reader = PdfReader(target)
    assert list(contents) == [p for p in pdf.toc_pages() if pages is None or p in pages]
    front = "".join(reader.pages[i].extract_text() for i in range(min(3, len(reader.pages))))
    previous = 0
    for title, start in contents.values():
        assert start > previous, (title, start)
        previous = start
        bare = title.split(". ", 1)[-1] if re.match(r"\d+\. ", title) else title
        first_page = "".join(reader.pages[start - 1].extract_text().split())
        assert "".join(bare.split(":")[0].split()) in first_page, (title, start)
        assert "".join(title.split()) in "".join(front.split()), title  # "√d ₖ" in the text
    text = "\n".join(page.extract_text() for page in reader.pages)
    assert "??" not in text
    assert [item.title for item in reader.outline] == [t for t, _ in contents.values()]
    return contents, text


# A few pages of the book, printed by `make test` on the core path: the landing page and a
# chapter with math, figures, exercises and deeper sections (the shortest such). `make
# check-release` prints all.
PDF_SAMPLE = ["chapters/intro.html", "chapters/14-build-it-yourself.html"]


def test_a_few_pages_print_as_a_book_on_the_core_path(build, tmp_path):
    """tools/pdf.py on PDF_SAMPLE with the switch on: a book (title page, contents, page
    numbers, outline) whose deeper sections are left out and whose core sections are printed."""
    import test_core_path_site as core_path

    _, _, out = build
    with timed("a PDF of a few pages"):
        _, text = printed_book(out / "html", tmp_path / "sample.pdf", core=True, pages=PDF_SAMPLE)
    problems = core_path.core_pdf_problems(out / "html", text, PDF_SAMPLE[1:])
    assert not problems, "\n".join(problems)


@pytest.mark.release
def test_pdf_holds_every_page_in_order_with_no_unresolved_reference(build, tmp_path):
    """`make pdf`'s whole book: every page, as printed_book checks it, and every chapter."""
    import pdf

    _, _, out = build
    contents, _ = printed_book(out / "html", tmp_path / "book.pdf", core=False)
    assert len(contents) == len(pdf.toc_pages()) >= 13
    chapters = [title for title, _ in contents.values() if re.match(r"\d+\. ", title)]
    assert len(chapters) == len(list((pathlib.Path(__file__).parents[1] / "chapters")
                                     .glob("[0-9][0-9]-*.md")))


# --- explorable figures and the figures' themes ----------------------------------------------

def test_at_least_six_explorable_figures_each_in_a_numbered_figure(build):
    _, _, out = build
    html_dir = out / "html"
    found = {}
    for page in pages_with(html_dir, 'class="explorable"'):
        text = (html_dir / page).read_text()
        ids = re.findall(r'<div class="explorable" id="(explorable-[a-z0-9-]+)">', text)
        found[page] = ids
        for fig in ids:
            label = "fig-" + fig.removeprefix("explorable-")
            figure = re.search(rf'<figure[^>]*id="{label}".*?</figure>', text, re.S)
            assert figure and fig in figure.group(0), f"{page}: {fig} is not inside figure {label}"
            assert "<figcaption" in figure.group(0), f"{page}: {label} has no caption"
        # The Vega libraries come from the site, named once per page however many figures it
        # has, and loaded by _static/explorable.js when a figure comes near the screen.
        assert len(re.findall(r'<meta name="explorable-bundle" content="[./]*_static/vega/'
                              r'vega-bundle\.js"', text)) == 1, page
        assert "<script" not in "".join(re.findall(r"<script[^>]*vega-bundle[^>]*>", text)), page
    figures = [fig for ids in found.values() for fig in ids]
    assert len(figures) >= 6, found
    assert len(set(figures)) == len(figures), found
    assert (html_dir / "_static" / "vega" / "vega-bundle.js").is_file()
    without = set(sb.html_pages(html_dir)) - set(found)
    for page in without:
        assert "vega-bundle.js" not in (html_dir / page).read_text(), (
            f"{page} has no explorable figure but loads the Vega bundle")


def test_explorable_figures_draw_offline_and_answer_the_keyboard(site):
    html_dir, reports = site
    drawn = [fig for report in reports.values() for fig in report.get("explorables", [])]
    assert len(drawn) >= 6, "fewer explorable figures visited than the site has"
    problems = failures(reports, lambda page, r: [f"{f['id']}: {p}" for f in r.get("explorables", [])
                                                 for p in f["problems"]])
    assert not problems, "explorable figures:\n" + format_failures(problems)


def test_figures_stand_out_from_their_background_in_the_light_theme(site):
    _, reports = site
    problems = failures(reports, lambda page, r: r.get("figure_contrast"))
    assert not problems, "figures that do not read in the light theme:\n" + format_failures(problems)


@pytest.mark.release
def test_the_core_path_switch_works_in_the_dark_theme(dark_site):
    switched = {page: r["core_switch"] for page, r in dark_site.items() if "core_switch" in r}
    assert switched, "no chapter visited in the dark theme"
    problems = core_path.switch_problems(switched)
    assert not problems, "\n".join(problems)


@pytest.mark.release
def test_figures_read_in_the_dark_theme_and_charts_follow_it(dark_site):
    assert dark_site, "no page with a figure"
    problems = {}
    for page, report in dark_site.items():
        found = list(report["figure_contrast"])
        if report["theme"] != "dark":
            found.append(f"the page's theme is {report['theme']!r}, not dark")
        drawn = len(report.get("chart_backgrounds", []))
        if drawn != report["explorables"]:
            found.append(f"{drawn} of {report['explorables']} explorable figures drawn in the dark theme")
        found += [f"an explorable chart has a light background in the dark theme: {bg}"
                  for bg in report.get("chart_backgrounds", []) if _luminance(
                      [int(c) for c in re.findall(r"\d+", bg)[:3]]) > 0.3]
        if found:
            problems[page] = found
    assert not problems, "figures in the dark theme:\n" + format_failures(problems)


def test_without_javascript_explorable_figures_show_their_still_image(no_script_site):
    assert no_script_site, "no page with an explorable figure"
    problems = {}
    for page, report in no_script_site.items():
        found = [f"{f['id']}: {f}" for f in report["explorables"] if not f["still"] or f["live"]]
        found += [f"alt text {alt!r}" for alt in report["alts"] if len(alt.split()) < 5]
        if found:
            problems[page] = found
    assert not problems, "explorable figures without JavaScript:\n" + format_failures(problems)

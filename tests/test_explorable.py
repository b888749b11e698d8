"""code/explorable.py and _ext/explorables.py without a build: what a figure writes, and what
the chapters ask of it. The figures in the built site are tested in tests/test_site.py."""

from __future__ import annotations

import base64
import html.parser
import json
import pathlib
import re
import sys

import altair as alt
import jupytext
import pytest
import vl_convert

import explorable as ex
from classroom import numbered_chapters

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "_ext"))
import explorables  # noqa: E402  (the Sphinx extension)

SLIDER = alt.param(name="k", value=1, bind=alt.binding_range(min=0, max=2, step=1, name="k "))
TABLE = [{"k": k, "x": x, "y": (k + 1) * x} for k in range(3) for x in range(4)]


def chart(with_param: bool = True):
    c = alt.Chart(alt.Data(values=TABLE)).mark_line().encode(x="x:Q", y="y:Q")
    return c.transform_filter(alt.datum.k == SLIDER).add_params(SLIDER) if with_param else c


class Block(html.parser.HTMLParser):
    """The elements of an explorable block: its div, the spec's script and the still image."""

    def __init__(self, text: str):
        super().__init__()
        self.tags, self.script = [], ""
        self._in_script = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.script += data


@pytest.fixture
def book(monkeypatch):
    monkeypatch.setenv(ex.BOOK_HTML, "1")


def test_outside_the_book_the_chart_itself_is_shown_with_its_description(monkeypatch):
    monkeypatch.delenv(ex.BOOK_HTML, raising=False)
    shown = ex.explorable(chart(), "demo", "three lines of rising slope")
    assert isinstance(shown, alt.TopLevelMixin)
    assert shown.to_dict()["description"] == "three lines of rising slope"


def test_in_the_book_a_block_with_a_stable_id_the_spec_and_a_still_image(book):
    shown = ex.explorable(chart(), "demo-figure", 'a line, "steeper" <as> k grows')
    bundle = shown._repr_mimebundle_()
    assert set(bundle) == {"text/html", "text/plain"}
    block = Block(bundle["text/html"])
    (div_tag, div), (script_tag, script), (img_tag, img) = block.tags
    assert (div_tag, div["class"], div["id"]) == ("div", "explorable", "explorable-demo-figure")
    assert (script_tag, script) == ("script", {"type": "application/json", "class": "explorable-spec"})
    spec = json.loads(block.script)
    assert spec == chart().properties(description='a line, "steeper" <as> k grows').to_dict()
    assert img_tag == "img" and img["class"] == "explorable-still"
    assert img["alt"] == 'a line, "steeper" <as> k grows'  # escaped in the HTML, intact here
    prefix = "data:image/svg+xml;base64,"
    assert img["src"].startswith(prefix)
    svg = base64.b64decode(img["src"][len(prefix):]).decode()
    assert svg == vl_convert.vegalite_to_svg(spec)
    # Built twice, byte for byte the same (the site's rebuild test needs it).
    again = ex.explorable(chart(), "demo-figure", 'a line, "steeper" <as> k grows')
    assert again._repr_mimebundle_() == bundle


def test_a_closing_script_tag_in_the_data_cannot_end_the_spec_early(book):
    table = [{"k": 0, "x": 0, "y": 0, "label": "</script><b>"}]
    c = (alt.Chart(alt.Data(values=table)).mark_text().encode(x="x:Q", y="y:Q", text="label:N")
         .add_params(SLIDER))
    text = ex.explorable(c, "demo", "one label")._repr_mimebundle_()["text/html"]
    assert text.count("</script>") == 1
    assert json.loads(Block(text).script)["data"]["values"][0]["label"] == "</script><b>"


@pytest.mark.parametrize("name", ["Demo", "1-demo", "demo figure", "demo_figure", "", None])
def test_a_name_that_is_not_a_plain_id_is_refused(name, book):
    with pytest.raises(ValueError, match="name must be lower-case"):
        ex.explorable(chart(), name, "some alt text")


@pytest.mark.parametrize("alt_text", ["", "   ", None])
def test_a_figure_without_alt_text_is_refused(alt_text, book):
    with pytest.raises(ValueError, match="give alt text"):
        ex.explorable(chart(), "demo", alt_text)


def test_a_chart_without_a_control_is_refused(book):
    with pytest.raises(ValueError, match="no parameter bound to a control"):
        ex.explorable(chart(with_param=False), "demo", "a still chart")


def test_bound_parameters_are_found_in_layers_and_concatenations():
    spec = alt.hconcat(chart(with_param=False), chart(with_param=False) + chart()).to_dict()
    assert ex._bound_params(spec) == ["k"]


def test_the_shipped_vega_lite_is_the_version_altair_writes_for():
    version = explorables.vegalite_version()
    assert version in vl_convert.get_vegalite_versions()
    assert alt.SCHEMA_VERSION.lstrip("v").startswith(version)
    text = explorables.bundle_text()
    assert f"Vega-Lite {version}" in text.splitlines()[0]
    for name in ("window.vegaEmbed", "window.vega", "window.vegaLite"):
        assert name in text
    assert "https://" not in text.split("\n", 1)[0]
    # In its own function scope: its top-level names (one is `_`, as in Sphinx's doctools.js)
    # would otherwise clash with the page's other scripts.
    assert text.split("\n", 1)[1].startswith("(() => {\n") and text.endswith("\n})();\n")


def explorable_cells() -> list[tuple[str, str, object]]:
    """(chapter, figure label, cell) for every code cell of a chapter that calls explorable()."""
    found = []
    for path in numbered_chapters():
        for cell in jupytext.read(path).cells:
            if cell.cell_type == "code" and re.search(r"^\s*explorable\(", cell.source, re.M):
                figure = cell.metadata.get("mystnb", {}).get("figure", {})
                found.append((path.stem, figure.get("name", ""), cell))
    return found


def test_each_explorable_figure_is_a_numbered_captioned_figure_named_after_it():
    """A cell that shows an explorable figure is a myst-nb figure labelled fig-<name>, so the
    figure's block id (explorable-<name>) and its label are found from each other."""
    for chapter, label, cell in explorable_cells():
        assert label.startswith("fig-"), f"{chapter}: an explorable() cell is not a named figure"
        assert f'"{label.removeprefix("fig-")}"' in cell.source, f"{chapter}: {label}"
        caption = cell.metadata["mystnb"]["figure"].get("caption", "")
        assert caption.startswith("Explorable:"), f"{chapter}: {label}'s caption"


def test_six_explorable_figures_across_the_chapters():
    found = explorable_cells()
    labels = [label for _, label, _ in found]
    assert len(labels) >= 6 and len(set(labels)) == len(labels), labels
    assert len({chapter for chapter, _, _ in found}) >= 5, labels  # spread over the chapters


def test_readme_shows_an_explorable_figure_in_a_screenshot():
    readme = (ROOT / "README.md").read_text()
    images = re.findall(r"!\[([^\]]+)\]\(([^)\s]+\.png)\)", readme)
    assert images, "README has no screenshot"
    for alt_text, src in images:
        path = ROOT / src
        assert path.is_file(), src
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", src
        assert len(alt_text.split()) >= 5, f"{src}: alt text {alt_text!r}"

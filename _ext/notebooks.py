"""Runnable Jupyter notebooks from the MyST chapters, written at the end of every build.

Jupyter and Colab do not understand MyST: an exercise directive shows up as a grey code block,
a glued number as `{glue:text}`key``. This extension reads each chapter with jupytext (so the
code cells are exactly the book's), rewrites the MyST markup of the markdown cells as plain
Markdown with everything the build resolved (section, figure, equation and exercise numbers,
cross-reference titles, citations, glued values) and writes two notebooks per chapter:

- ``html/_sources/<chapter>.ipynb``, with the build's outputs: the page's download button;
- ``notebooks/<chapter>.ipynb`` beside ``html/``, without outputs: ``make notebooks`` copies
  these to chapters/, where the Colab and Binder launch buttons find them, and
  tests/test_book.py fails when the committed copies differ from what the build writes.

Where the exercises, checks, solutions and the setup cell are comes from
tools/chapter_structure.py, which also names the cell tags that mark them in the notebook: the
setup cell (inserted after the title, as in the build) is tagged ``setup``, each exercise
statement is a cell of its own tagged ``exercise``, a cell that imports a check ``check``, and
every cell of a solution ``solution``, so that tools/classroom.py can find them. Numbers glued
from cells tagged ``wall-clock`` are timings that change on every run; the notebooks point at
the cell output instead of freezing one build's measurement.
"""

from __future__ import annotations

import ast
import codecs
import copy
import json
import re
import sys
from pathlib import Path

import latexcodec  # noqa: F401  (registers the "ulatex" codec; sphinxcontrib-bibtex needs it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import chapter_structure as structure  # noqa: E402

ROLE = re.compile(r"\{([\w:-]+)\}`([^`]*)`")
PROOF_TITLES = {"prf:definition": "Definition", "prf:lemma": "Lemma", "prf:theorem": "Theorem",
                "prf:proposition": "Proposition", "prf:corollary": "Corollary",
                "prf:remark": "Remark", "prf:algorithm": "Algorithm"}
ADMONITIONS = {"note": "Note", "tip": "Tip", "warning": "Warning"}
WALL_CLOCK_TEXT = "(measured when the notebook runs: see the output above)"


class ConversionError(Exception):
    pass


class Resolver:
    """Everything the build knows that a markdown cell needs: numbers, titles, values."""

    def __init__(self, env, docname: str, glue: dict, wall_clock: set[str]):
        self.env, self.docname, self.glue, self.wall_clock = env, docname, glue, wall_clock
        self.cited: list[str] = []
        citations = env.domaindata["cite"]["citations"]
        self.entries = {c.key: c for c in citations}

    # numbers ---------------------------------------------------------------------------------
    def number(self, kind: str, key: str) -> str:
        for doc, kinds in self.env.toc_fignumbers.items():
            if key in kinds.get(kind, {}):
                return ".".join(map(str, kinds[kind][key]))
        raise ConversionError(f"{self.docname}: no number for {kind} {key!r}")

    def equation(self, label: str) -> str:
        return self.number("displaymath", f"equation-{label}")

    def numref(self, label: str, template: str | None) -> str:
        for doc, kinds in self.env.toc_fignumbers.items():
            for kind, numbers in kinds.items():
                if label in numbers:
                    number = ".".join(map(str, numbers[label]))
                    template = template or self.env.config.numfig_format[kind]
                    return template.replace("%s", number).replace("{number}", number)
        raise ConversionError(f"{self.docname}: {{numref}} to unknown label {label!r}")

    def ref(self, label: str) -> str:
        labels = self.env.domaindata["std"]["labels"]
        if label not in labels:
            raise ConversionError(f"{self.docname}: {{ref}} to unknown label {label!r}")
        doc, _, title = labels[label]
        number = self.env.toc_secnumbers.get(doc, {}).get("")
        if number and str(self.env.titles[doc].astext()) == str(title):  # a whole chapter
            return f"*{title}* (Chapter {number[0]})"
        return f"*{title}*"

    def proof_ref(self, label: str) -> str:
        proof = self.env.proof_list.get(label)
        if proof is None:
            raise ConversionError(f"{self.docname}: {{prf:ref}} to unknown label {label!r}")
        kind = proof["realtype"]
        return f"{kind.capitalize()} {self.number(kind, label)}"

    # values ----------------------------------------------------------------------------------
    def glue_text(self, spec: str) -> str:
        key, _, fmt = spec.rpartition(":") if ":" in spec else (spec, "", "")  # as myst-nb
        if key in self.wall_clock:
            return WALL_CLOCK_TEXT
        if key not in self.glue:
            raise ConversionError(f"{self.docname}: no glued value {key!r}")
        from myst_nb.core.variables import format_plain_text
        return format_plain_text(self.glue[key]["data"]["text/plain"], fmt or "s")

    def glue_math(self, key: str) -> str:
        data = self.glue[key]["data"]
        tex = data.get("text/latex") or data["text/plain"]
        tex = tex.strip().strip("$").strip()
        return tex.removeprefix("\\displaystyle").strip()

    # citations -------------------------------------------------------------------------------
    def authors(self, key: str) -> tuple[str, str]:
        entry = self.entries[key].entry
        people = entry.persons.get("author") or entry.persons.get("editor")
        names = [" ".join(p.prelast_names + p.last_names) for p in people]
        names = [codecs.decode(n, "ulatex").replace("{", "").replace("}", "") for n in names]
        if len(names) >= 3 or "others" in names:
            who = f"{names[0]} et al."
        elif len(names) == 2:
            who = f"{names[0]} and {names[1]}"
        else:
            who = names[0]
        return who, entry.fields.get("year", "n.d.")

    def cite(self, role: str, keys: str) -> str:
        keys_list = [k.strip() for k in keys.split(",")]
        for key in keys_list:
            if key not in self.entries:
                raise ConversionError(f"{self.docname}: unknown citation {key!r}")
            if key not in self.cited:
                self.cited.append(key)
        pairs = [self.authors(k) for k in keys_list]
        if role == "cite:t":
            return ", ".join(f"{who} ({year})" for who, year in pairs)
        return "(" + "; ".join(f"{who}, {year}" for who, year in pairs) + ")"

    def references(self) -> str:
        lines = ["## References", ""]
        for key in sorted(self.cited, key=lambda k: self.authors(k)):
            text = self.entries[key].formatted_entry.text.render_as("text")
            lines.append(f"- {text}")
        return "\n".join(lines)


def convert_inline(text: str, res: Resolver) -> str:
    """Replace every MyST role in a line of prose by the text the book shows."""

    def replace(match: re.Match) -> str:
        role, content = match.groups()
        explicit = re.fullmatch(r"(.*?)\s*<([^<>]+)>", content, re.S)
        if role == "ref":
            return explicit.group(1) if explicit else res.ref(content)
        if role == "numref":
            if explicit:
                return res.numref(explicit.group(2), explicit.group(1))
            return res.numref(content, None)
        if role == "eq":
            return f"({res.equation(content)})"
        if role == "prf:ref":
            return explicit.group(1) if explicit else res.proof_ref(content)
        if role in ("cite:p", "cite:t"):
            return res.cite(role, content)
        if role == "glue:text":
            return res.glue_text(content)
        raise ConversionError(f"{res.docname}: no conversion for the role {{{role}}}")

    return ROLE.sub(replace, text)


class Converter:
    """Rewrites the markdown cells of one chapter, part by part, in reading order."""

    def __init__(self, res: Resolver, srcdir: Path):
        self.res, self.srcdir = res, srcdir
        self.headings = list(res.env.toc_secnumbers[res.docname].values())
        self.heading_index = 0
        self.deeper_next = False  # an {rst-class} deeper was met: the next heading is deeper

    def heading(self, line: str) -> str:
        hashes, title = re.match(r"(#+)\s+(.*)", line).groups()
        if self.heading_index >= len(self.headings):
            raise ConversionError(f"{self.res.docname}: more headings than sections")
        number = self.headings[self.heading_index]
        self.heading_index += 1
        label = ".".join(map(str, number)) + ("." if len(number) == 1 else "")
        badge = " (deeper)" if self.deeper_next else ""  # as the page's badge (_ext/core_path.py)
        self.deeper_next = False
        return f"{hashes} {label} {convert_inline(title, self.res)}{badge}"

    def render(self, lines: list[str], top: bool = False,
               tag: str | None = None) -> list[tuple[str, str | None]]:
        """Markdown for the lines, as (text, tag) segments in order: tag is the cell tag of the
        segment (``tag``, or "exercise" for an exercise statement, a segment of its own)."""
        out: list[tuple[str, str | None]] = []

        def emit(text: str, kind: str | None = tag):
            if out and out[-1][1] == kind and kind != structure.EXERCISE:
                out[-1] = (out[-1][0] + "\n" + text, kind)
            else:
                out.append((text, kind))

        for block in structure.blocks(lines):
            if block.verbatim:
                emit("\n".join(block.lines))
                continue
            if block.name is None:
                line = block.lines[0]
                if re.fullmatch(r"\(\S+\)=\s*", line):
                    continue  # a MyST target: the notebook has no use for it
                if top and re.match(r"#{1,6}\s", line):
                    emit(self.heading(line))
                    continue
                m = re.fullmatch(r"\$\$\s*\((\S+)\)\s*", line)
                if m:
                    emit(f"\\tag{{{self.res.equation(m.group(1))}}}\n$$")
                    continue
                emit(convert_inline(line, self.res))
                continue
            name, arg = block.name, block.argument
            opts, body = structure.options(block.body)
            if name == "solution-start":
                number = self.res.number("exercise", arg)
                emit(structure.solution_heading(number) + "\n")
            elif name == "solution-end":
                pass
            elif name == "solution":
                number = self.res.number("exercise", arg)
                emit(f"{structure.solution_heading(number)}\n\n{self.text(body)}")
            elif name == "exercise":
                number = self.res.number("exercise", opts["label"])
                title = convert_inline(arg, self.res)
                emit(structure.exercise_markdown(number, title, self.text(body)),
                     structure.EXERCISE)
            elif name in PROOF_TITLES:
                kind = name.split(":")[1]
                number = self.res.number(kind, opts["label"]) if "label" in opts else ""
                title = f" ({convert_inline(arg, self.res)})" if arg else ""
                emit(f"**{PROOF_TITLES[name]} {number}{title}.** {self.text(body)}")
            elif name == "prf:proof":
                emit(f"*Proof.* {self.text(body)} ∎")
            elif name in ADMONITIONS or name == "admonition":  # a titled one names itself
                title = convert_inline(arg, self.res) if name == "admonition" else ADMONITIONS[name]
                quoted = "\n".join(f"> {line}".rstrip() for line in
                                   f"**{title}.** {self.text(body)}".splitlines())
                emit(quoted)
            elif name == "dropdown":
                emit(f"**{convert_inline(arg, self.res)}**\n\n{self.text(body)}")
            elif name == "glue:math":
                tag_line = (f"\n\\tag{{{self.res.equation(opts['label'])}}}"
                            if "label" in opts else "")
                emit(f"$$\n{self.res.glue_math(arg)}{tag_line}\n$$")
            elif name == "rst-class" and arg.split() == ["deeper"]:
                self.deeper_next = True
            elif name == "literalinclude":
                emit(self.listing(arg, opts))
            else:
                raise ConversionError(f"{self.res.docname}: no conversion for {{{name}}}")
        return out

    def text(self, lines: list[str]) -> str:
        return "\n".join(text for text, _ in self.render(lines)).strip("\n")

    def listing(self, path: str, opts: dict[str, str]) -> str:
        source = (self.srcdir / Path(self.res.docname).parent / path).resolve().read_text()
        if "pyobject" in opts:  # a name, or Class.method, as Sphinx's literalinclude reads it
            node = ast.parse(source)
            for name in opts["pyobject"].split("."):
                node = next(n for n in node.body if getattr(n, "name", None) == name)
            lines = source.splitlines()[node.lineno - 1 - len(node.decorator_list):node.end_lineno]
            source = "\n".join(lines)
        elif set(opts) - {"language"}:
            raise ConversionError(f"{self.res.docname}: literalinclude options {opts}")
        return f"```python\n{source.rstrip()}\n```"


def markdown_cell(source: str, tags: list[str]):
    import nbformat
    cell = nbformat.v4.new_markdown_cell(source.strip("\n"))
    if tags:
        cell.metadata["tags"] = tags
    return cell


def convert(md_path: Path, env, docname: str, glue: dict, executed=None):
    """The chapter as a plain Jupyter notebook (outputs from ``executed`` when given)."""
    import nbformat
    from nbconvert.preprocessors import CoalesceStreamsPreprocessor

    source = structure.chapter_notebook(md_path)
    wall_clock = set()
    for cell in source.cells:
        if cell.cell_type == "code" and "wall-clock" in structure.tags(cell):
            wall_clock.update(re.findall(r"glue\(\s*\"([^\"]+)\"", cell.source))
    res = Resolver(env, docname, glue, wall_clock)
    converter = Converter(res, Path(env.srcdir))
    executed_code = None
    if executed is not None:
        # Consecutive prints to one stream joined, as the book shows them: how a kernel splits
        # a cell's printing into messages varies from run to run; joined, the download
        # notebook is the same on every build.
        executed, _ = CoalesceStreamsPreprocessor().preprocess(copy.deepcopy(executed), {})
        executed_code = [c for c in executed.cells if c.cell_type == "code"]
        wanted = [c.source for c in source.cells if c.cell_type == "code"]
        if [c.source for c in executed_code] != wanted:
            raise ConversionError(f"{docname}: executed notebook does not match the source")
    cells, code_index = [], 0
    for part in structure.parts(source):
        solution = structure.SOLUTION if part.solution_of is not None else None
        if part.cell.cell_type == "markdown":
            for text, tag in converter.render(part.lines, top=True, tag=solution):
                if text.strip():
                    cells.append(markdown_cell(text, [tag] if tag else []))
            continue
        cell = part.cell
        tags = structure.tags(cell)
        if solution and solution not in tags:
            tags.append(solution)
        if structure.imported_checks(cell.source):
            tags.append(structure.CHECK)
        new = nbformat.v4.new_code_cell(cell.source)
        if tags:
            new.metadata["tags"] = tags
        if {"remove-cell", "remove-input", "hide-input"} & set(tags):
            new.metadata["jupyter"] = {"source_hidden": True}  # folded, as in the book
        if executed_code is not None:
            new.outputs = executed_code[code_index].outputs
            new.execution_count = executed_code[code_index].execution_count
        code_index += 1
        cells.append(new)
        figure = cell.metadata.get("mystnb", {}).get("figure")
        if figure:
            number = res.number("figure", figure["name"])
            caption = convert_inline(" ".join(figure["caption"].split()), res)
            cells.append(markdown_cell(f"**Fig. {number}.** {caption}",
                                       [solution] if solution else []))
    if converter.heading_index != len(converter.headings):
        raise ConversionError(f"{docname}: {converter.heading_index} headings for "
                              f"{len(converter.headings)} sections")
    if res.cited:
        cells.append(markdown_cell(res.references(), []))
    for index, cell in enumerate(cells):
        cell.id = f"cell-{index}"  # nbformat draws random ids; rebuilds must not change a byte
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        # What the notebook was made from, so `make student` and `make assignments` can refuse
        # a committed notebook that is older than its chapter (tools/classroom.py).
        "made_from": made_from(md_path, Path(env.srcdir)),
    }
    return notebook


def made_from(md_path: Path, srcdir: Path) -> dict[str, str]:
    """{path: sha256} of the chapter source and the book's code its numbers come from."""
    import hashlib
    code = sorted((srcdir / "code").glob("*.py"))
    return {str(path.relative_to(srcdir)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in (md_path, *code)}


def strip_outputs(notebook):
    stripped = copy.deepcopy(notebook)
    for cell in stripped.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return stripped


def dumps(notebook) -> str:
    import nbformat
    return nbformat.writes(notebook) + "\n"


def count_reads(app, env, docnames) -> None:
    app._notebooks_docs_read = len(docnames)  # the pages this build reads again


def write_notebooks(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    import nbformat

    out = Path(app.outdir)
    execute_dir = out.parent / "jupyter_execute"
    chapters = [doc for doc in sorted(app.env.found_docs) if structure.CHAPTER_DOC.match(doc)]
    written = [out.parent / "notebooks" / f"{doc}.ipynb" for doc in chapters]
    if not getattr(app, "_notebooks_docs_read", 1) and all(p.exists() for p in written):
        return  # no page was read again, so nothing a notebook is made from has changed
    for docname, plain in zip(chapters, written):
        glue_file = execute_dir / f"{docname}.glue.json"
        glue = json.loads(glue_file.read_text()) if glue_file.exists() else {}
        executed = nbformat.read(execute_dir / f"{docname}.ipynb", as_version=4)
        notebook = convert(Path(app.srcdir) / f"{docname}.md", app.env, docname, glue, executed)
        download = out / "_sources" / f"{docname}.ipynb"
        download.parent.mkdir(parents=True, exist_ok=True)
        download.write_text(dumps(notebook))
        plain.parent.mkdir(parents=True, exist_ok=True)
        plain.write_text(dumps(strip_outputs(notebook)))


def drop_launch_without_notebook(app, pagename, templatename, context, doctree) -> None:
    """sphinx-book-theme gives every executed page Colab and Binder buttons, pointing to the
    page's .ipynb when one sits beside its source and to the .md otherwise, which Colab cannot
    open. Only the chapters have notebooks (written here, committed by `make notebooks`): an
    executed page without one (the appendix) keeps its download button and loses the launch
    buttons."""
    buttons = context.get("header_buttons")
    source = Path(app.srcdir, pagename + ".ipynb")
    if buttons and not source.exists():
        buttons[:] = [b for b in buttons if b.get("label") != "launch-buttons"]


def setup(app):
    app.connect("env-before-read-docs", count_reads)
    app.connect("build-finished", write_notebooks)
    app.connect("html-page-context", drop_launch_without_notebook, priority=502)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

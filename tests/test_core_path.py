"""_ext/core_path.py: what counts as a chapter's prose, and what belongs to its core."""

from __future__ import annotations

import pathlib
import sys

from docutils.core import publish_doctree

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "_ext"))
import core_path  # noqa: E402

CHAPTER = """
Title
=====

One two three four.

.. container:: cell

   These six words are a code cell.

Core
----

Five six seven :math:`x^2` eight.

.. math::

   a + b = c

::

   literal code is not prose

.. class:: deeper

Deeper
------

Nine ten eleven.

Inside
~~~~~~

Twelve thirteen.

Exercises
---------

Not counted at all, being exercises.
"""


def test_prose_is_counted_and_the_deeper_sections_are_kept_apart():
    doctree = publish_doctree(CHAPTER, settings_overrides={"report_level": 5})
    deeper = [s for s in doctree.findall(core_path.nodes.section) if core_path.is_deeper(s)]
    assert [s["ids"] for s in deeper] == [["deeper"]]
    assert core_path.outermost_deeper(doctree) == deeper
    whole, core = core_path.count_words(doctree)
    # Titles count (Title, Core, Deeper, Inside): the formula is one word.
    assert core == len("Title One two three four Core Five six seven x2 eight".split())
    assert whole == core + len("Deeper Nine ten eleven Inside Twelve thirteen".split())


def test_reading_time_rounds_to_whole_minutes_and_is_never_zero():
    assert core_path.minutes(0) == 1
    assert core_path.minutes(core_path.WORDS_PER_MINUTE * 7.4) == 7
    assert core_path.minutes(core_path.WORDS_PER_MINUTE * 7.6) == 8

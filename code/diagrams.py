"""Architecture and data-flow diagrams of the book's code, drawn with matplotlib.

Each diagram is a function that takes the real objects (tensors, a ``MultiHeadAttention``, a
``KVCache``, a ``TransformerBlock``, a ``torch.nn.Transformer``) and reads every shape and size
it labels from them, or from running them, never from numbers typed here. Each returns the
matplotlib Figure it drew on; with ``ax=`` it draws into that Axes instead (two blocks side by
side, say), shrinking its text and lines with the Axes when the Axes is smaller than the
diagram's own size. ``drawing(fig_or_ax)`` gives back what a diagram drew, its boxes and the
text of every label, so that a chapter or a test can check the labels against the objects.

    attention_flow_diagram   scaled dot-product attention, from Q, K, V to the output (ch. 2)
    multihead_diagram        multi-head attention: split into heads, attend, merge   (ch. 6)
    cross_attention_diagram  queries from the decoder, keys and values from the encoder (ch. 7)
    encoder_decoder_diagram  the encoder-decoder Transformer of an nn.Transformer    (ch. 7)
    kv_cache_diagram         one decoding step with the key-value cache              (ch. 9)
    flash_tiles_diagram      FlashAttention's tiles, its loop order, its fast memory (ch. 10)
    block_diagram            one TransformerBlock of code/transformer.py, pre- or post-LN
    decoder_only_diagram     a decoder-only language model made of TransformerBlocks
    induction_circuit_diagram  an induction circuit's two heads on one sequence         (ch. 12)

Every diagram is drawn on white with black text and light, colour-blind-safe fills (tints of
the Okabe-Ito palette), and every box says in words what it is, so no colour carries meaning
alone. Shapes are written with the letters of the book's notation page, then in numbers:
``(B, T, d_model) = (2, 5, 8)``. Matplotlib is the only tool: the diagrams render offline, in
Colab unchanged, and in the book as SVG like every other figure.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, Rectangle
from torch import Tensor, nn

from attention import (KVCache, MultiHeadAttention, _apply_mask, _check_qkv, repeat_kv,
                       scaled_dot_product_attention)
from flash import flash_attention, visited_tiles
from transformer import TransformerBlock

__all__ = [
    "attention_flow_diagram",
    "multihead_diagram",
    "cross_attention_diagram",
    "encoder_decoder_diagram",
    "kv_cache_diagram",
    "flash_tiles_diagram",
    "block_diagram",
    "decoder_only_diagram",
    "induction_circuit_diagram",
    "drawing",
    "Drawing",
    "Box",
    "BLOCK_FIGSIZE",
]

UNIT = 0.5  # inches per data unit, in a figure a diagram makes for itself
FONT = 10.0  # points: the labels of boxes
SMALL = 9.0  # points: shapes and notes
INK = "#1a1a1a"  # text, edges, lines and arrows
STREAM = 2.2  # line width of a residual stream


def _tint(colour: str, amount: float) -> str:
    """``colour`` mixed with white (``amount`` of the colour): a fill that black text reads on."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - amount * (255 - c)):02x}" for c in rgb)


# Light tints of the Okabe-Ito palette, one per kind of box.
FILLS = {
    "io": "#e8e8e8",                      # inputs and outputs
    "attention": _tint("#56B4E9", 0.35),  # sky blue
    "mlp": _tint("#E69F00", 0.35),        # orange
    "norm": _tint("#009E73", 0.30),       # bluish green
    "linear": _tint("#CC79A7", 0.30),     # reddish purple
    "softmax": _tint("#F0E442", 0.45),    # yellow
    "mask": _tint("#D55E00", 0.22),       # vermillion
    "cache": _tint("#0072B2", 0.22),      # blue
    "new": _tint("#E69F00", 0.60),        # what the new token adds
    "skipped": "#f4f4f4",
}


# ---------------------------------------------------------------------------------------------
# What a diagram drew


@dataclass
class Box:
    """A labelled box (or the circle of an addition): label, centre and size in data units."""
    label: str
    x: float
    y: float
    w: float
    h: float
    kind: str
    patch: object = field(repr=False)
    text: object = field(repr=False)


@dataclass
class Drawing:
    """What one diagram drew into its Axes: its boxes, the grid cells of its matrices and the
    text inside them, the frames that enclose other boxes, and every text artist (the boxes'
    labels, the labels of arrows, the notes). ``scale`` is the size of its text and lines
    relative to the diagram's own figure: 1 there, less in an Axes too small for it."""
    ax: Axes
    own: bool
    scale: float = 1.0
    boxes: list = field(default_factory=list)
    cells: list = field(default_factory=list)
    cell_texts: list = field(default_factory=list)
    frames: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    lines: list = field(default_factory=list)  # Line2D and FancyArrowPatch artists
    extent: list = field(default_factory=lambda: [math.inf, math.inf, -math.inf, -math.inf])

    @property
    def labels(self) -> list[str]:
        """The text of every label drawn, in the order drawn."""
        return [t.get_text() for t in self.texts]

    def box(self, label: str) -> Box:
        """The one box whose label contains ``label``."""
        found = [b for b in self.boxes if label in b.label]
        if len(found) != 1:
            raise LookupError(f"{len(found)} boxes have {label!r} in their label: "
                              f"{[b.label for b in found]}")
        return found[0]

    def cover(self, x0, y0, x1, y1):
        """Widen the region the diagram occupies (data units) to hold this rectangle."""
        e = self.extent
        e[:] = [min(e[0], x0, x1), min(e[1], y0, y1), max(e[2], x0, x1), max(e[3], y0, y1)]

    def text(self, x, y, text, *, size=SMALL, ha="center", va="center", cell=False, **kw):
        artist = self.ax.text(x, y, text, ha=ha, va=va, fontsize=size, color=INK, zorder=5,
                              **kw)
        self.texts.append(artist)
        if cell:
            self.cell_texts.append(artist)
        return artist


def drawing(target) -> Drawing:
    """What the diagram in ``target`` drew: a Figure that holds one diagram, or its Axes."""
    if isinstance(target, Figure):
        found = [ax._diagram for ax in target.axes if hasattr(ax, "_diagram")]
        if len(found) != 1:
            raise ValueError(f"the figure holds {len(found)} diagrams; pass the Axes of one")
        return found[0]
    if isinstance(target, Axes) and hasattr(target, "_diagram"):
        return target._diagram
    raise ValueError(f"no diagram is drawn in this {type(target).__name__}")


# ---------------------------------------------------------------------------------------------
# Helpers: a canvas, boxes, grids, arrows and lines, and the fit of the canvas to them


def _canvas(ax: Optional[Axes]) -> Drawing:
    """A Drawing on ``ax``, or on a new white figure that ``_finish`` sizes to the diagram."""
    import matplotlib.pyplot as plt

    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(8, 8))
        fig.patch.set_facecolor("white")
        fig.subplots_adjust(left=0, right=1, bottom=0, top=1)
    elif not isinstance(ax, Axes):
        raise TypeError(f"ax must be a matplotlib Axes, got {type(ax).__name__}")
    ax.set_xlim(0, 16)  # provisional: _finish fits the limits to what was drawn
    ax.set_ylim(0, 16)
    ax.set_aspect("equal")
    ax.set_facecolor("white")
    ax.axis("off")
    d = Drawing(ax, own)
    ax._diagram = d
    return d


def _finish(d: Drawing, *, limits: Optional[tuple] = None, margin: float = 0.15) -> Figure:
    """Fit the Axes' limits to everything drawn (text measured as rendered), or set them to
    ``limits`` (x0, y0, x1, y1); size a figure the diagram made to UNIT inches a data unit;
    in a given Axes, shrink text and lines in proportion when the Axes is smaller."""
    ax, fig = d.ax, d.ax.figure
    if limits is None:
        dpi = fig.dpi
        for text in d.texts:  # a text's size does not depend on the limits: measure it
            box = text.get_window_extent()
            ax_x, ax_y = ax.transData.transform(text.get_position())
            per_unit = dpi * UNIT  # pixels per data unit at the diagram's own scale
            x, y = text.get_position()
            d.cover(x + (box.x0 - ax_x) / per_unit, y + (box.y0 - ax_y) / per_unit,
                    x + (box.x1 - ax_x) / per_unit, y + (box.y1 - ax_y) / per_unit)
        x0, y0, x1, y1 = d.extent
        x0, y0, x1, y1 = x0 - margin, y0 - margin, x1 + margin, y1 + margin
    else:
        x0, y0, x1, y1 = limits
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    if d.own:
        fig.set_size_inches((x1 - x0) * UNIT, (y1 - y0) * UNIT)
        return fig
    ax.apply_aspect()
    position = ax.get_position()
    fig_w, fig_h = fig.get_size_inches()
    per_unit = min(position.width * fig_w / (x1 - x0), position.height * fig_h / (y1 - y0))
    d.scale = min(1.0, per_unit / UNIT)
    if d.scale < 1.0:
        for text in d.texts:
            text.set_fontsize(text.get_fontsize() * d.scale)
        for artist in [*d.lines, *(b.patch for b in d.boxes), *d.cells, *d.frames]:
            artist.set_linewidth(artist.get_linewidth() * d.scale)
            if isinstance(artist, FancyArrowPatch):
                artist.set_mutation_scale(artist.get_mutation_scale() * d.scale)
    return fig


def _box(d: Drawing, x, y, w, h, label, kind="io", *, size=FONT, dashed=False,
         weight="normal"):
    """A rounded box centred at (x, y), w x h data units, its label in the middle."""
    patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h,
                           boxstyle=f"round,pad=0,rounding_size={min(0.15, h / 4)}",
                           facecolor=FILLS[kind], edgecolor=INK, linewidth=1.0,
                           linestyle=(0, (4, 2)) if dashed else "-", zorder=2)
    d.ax.add_patch(patch)
    text = d.text(x, y, label, size=size, weight=weight, linespacing=1.3)
    box = Box(label, x, y, w, h, kind, patch, text)
    d.boxes.append(box)
    d.cover(x - w / 2, y - h / 2, x + w / 2, y + h / 2)
    return box


def _frame(d: Drawing, x0, y0, x1, y1):
    """A rounded outline around other boxes (a repeated block, a memory)."""
    patch = FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0,rounding_size=0.2",
                           facecolor="none", edgecolor="#555555", linewidth=1.0, zorder=0)
    d.ax.add_patch(patch)
    d.frames.append(patch)
    d.cover(x0, y0, x1, y1)
    return patch


def _plus(d: Drawing, x, y, r=0.22):
    """The addition of a residual connection: a circled plus at (x, y)."""
    patch = Circle((x, y), r, facecolor="white", edgecolor=INK, linewidth=1.2, zorder=4)
    d.ax.add_patch(patch)
    text = d.text(x, y, "+", size=FONT + 1)
    box = Box("+", x, y, 2 * r, 2 * r, "add", patch, text)
    d.boxes.append(box)
    d.cover(x - r, y - r, x + r, y + r)
    return box


def _cell(d: Drawing, x, y, w, h, kind, *, label=None, hatch=None, lw=0.7, size=SMALL):
    """One cell of a grid, lower-left corner (x, y), with an optional label inside."""
    patch = Rectangle((x, y), w, h, facecolor=FILLS[kind], edgecolor=INK, linewidth=lw,
                      hatch=hatch, zorder=2)
    d.ax.add_patch(patch)
    d.cells.append(patch)
    d.cover(x, y, x + w, y + h)
    if label is not None:
        d.text(x + w / 2, y + h / 2, label, size=size, cell=True)
    return patch


def _arrow(d: Drawing, start, end, label=None, *, side="right", size=SMALL, offset=0.15):
    """An arrow from ``start`` to ``end``, its label beside the middle (``side``: right, left,
    above, below)."""
    arrow = FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11,
                            linewidth=1.1, color=INK, shrinkA=0, shrinkB=0, zorder=1)
    d.ax.add_patch(arrow)
    d.lines.append(arrow)
    d.cover(*start, *end)
    if label:
        mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
        x, y, ha, va = {"right": (mx + offset, my, "left", "center"),
                        "left": (mx - offset, my, "right", "center"),
                        "above": (mx, my + offset, "center", "bottom"),
                        "below": (mx, my - offset, "center", "top")}[side]
        d.text(x, y, label, size=size, ha=ha, va=va)


def _line(d: Drawing, xs, ys, *, width=1.1, dashed=False, zorder=1):
    """A polyline through the points (xs[i], ys[i])."""
    line, = d.ax.plot(xs, ys, color=INK, linewidth=width, zorder=zorder,
                      linestyle=(0, (4, 2)) if dashed else "-", solid_capstyle="butt")
    d.lines.append(line)
    d.cover(min(xs), min(ys), max(xs), max(ys))
    return line


def _dot(d: Drawing, x, y):
    """Where a branch leaves a residual stream."""
    d.ax.add_patch(Circle((x, y), 0.07, color=INK, zorder=4))


def _shape(t) -> tuple[int, ...]:
    return tuple(int(n) for n in (t.shape if isinstance(t, Tensor) else t))


def _named(letters: Sequence[str], sizes: Sequence) -> str:
    """'(L, d_k) = (4, 3)': a shape in the notation's letters, then in numbers."""
    return f"({', '.join(letters)}) = ({', '.join(str(n) for n in sizes)})"


def _letters(lead: Sequence[int], *last: str) -> list[str]:
    """The letters of a shape with ``len(lead)`` leading axes (B; B, H; else '...')."""
    return [*{0: [], 1: ["B"], 2: ["B", "H"]}.get(len(lead), ["..."] * len(lead)), *last]


def _check_type(obj, cls, name: str, what: str):
    if not isinstance(obj, cls):
        raise TypeError(f"{name} draws {what}; got {type(obj).__name__}")


def _describe(x) -> str:
    return f"shape {_shape(x)}" if isinstance(x, Tensor) else type(x).__name__


# ---------------------------------------------------------------------------------------------
# Chapter 2: scaled dot-product attention


def attention_flow_diagram(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Optional[Tensor] = None,
                           is_causal: bool = False, ax: Optional[Axes] = None) -> Figure:
    """The data flow of ``scaled_dot_product_attention(q, k, v)``, top to bottom: Q times K^T,
    the scale 1/sqrt(d_k), the mask (a dashed box when there is none), the softmax along each
    row, the product with V. Every shape is read from q ``(..., L, d_k)``, k ``(..., S,
    d_k)``, v ``(..., S, d_v)`` and the mask; leading axes are named B, then H."""
    _check_qkv(q, k, v)
    L, d_k = q.shape[-2:]
    S, d_v = v.shape[-2:]
    lead = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    if attn_mask is not None:  # the module's own check, on scores of zeros
        _apply_mask(torch.zeros(*lead, L, S), attn_mask, q, k)
    masked = attn_mask is not None or bool(is_causal)

    def shape(t_lead, *axes):  # axes: letter, size, letter, size, ...
        return _named(_letters(t_lead, *axes[::2]), [*t_lead, *axes[1::2]])

    scores = shape(lead, "L", L, "S", S)
    d = _canvas(ax)
    xc, w = 5.0, 6.4  # the column of steps
    q_box = _box(d, 2.6, 12.3, 4.4, 1.1, "$Q$, the queries\n" + shape(
        _shape(q.shape[:-2]), "L", L, "d_k", d_k), size=SMALL)
    k_box = _box(d, 7.4, 12.3, 4.4, 1.1, "$K$, the keys\n" + shape(
        _shape(k.shape[:-2]), "S", S, "d_k", d_k), size=SMALL)
    if attn_mask is None and not is_causal:
        mask = "mask, if any: $-\\infty$ where\na query may not attend"
    else:
        what = ([] if attn_mask is None else [f"mask {_shape(attn_mask)}"]) + (
            ["causal"] if is_causal else [])
        mask = " and ".join(what) + (": added to the scores" if attn_mask is not None and
                                     attn_mask.is_floating_point() and not is_causal else
                                     ": $-\\infty$ where\na query may not attend")
    steps = [(10.2, "$QK^\\top$: the dot product of\nevery query with every key", "linear"),
             (8.4, f"divide by $\\sqrt{{d_k}}$, $d_k$ = {d_k}", "linear"),
             (6.6, mask, "mask"),
             (4.8, "softmax along each row\n(over the S keys)", "softmax"),
             (3.0, "weights times values: $AV$", "linear")]
    boxes = [_box(d, xc, y, w, 1.1 if "\n" in text else 0.75, text, kind,
                  dashed=kind == "mask" and not masked) for y, text, kind in steps]
    _arrow(d, (q_box.x, q_box.y - 0.55), (q_box.x, boxes[0].y + 0.55))
    _arrow(d, (k_box.x, k_box.y - 0.55), (k_box.x, boxes[0].y + 0.55),
           "transposed: $K^\\top$\n" + shape(lead, "d_k", d_k, "S", S))
    flowing = [scores, "scores $Z$: " + scores, ("masked scores: " if masked else "") + scores,
               "weights $A$: " + scores + "\neach row sums to 1"]
    for upper, lower, text in zip(boxes, boxes[1:], flowing):
        _arrow(d, (xc, upper.y - upper.h / 2), (xc, lower.y + lower.h / 2), text)
    v_box = _box(d, 11.4, 4.8, 4.0, 1.1, "$V$, the values\n" + shape(
        _shape(v.shape[:-2]), "S", S, "d_v", d_v), size=SMALL)
    _line(d, [v_box.x, v_box.x], [v_box.y - 0.55, boxes[4].y])
    _arrow(d, (v_box.x, boxes[4].y), (xc + w / 2, boxes[4].y))
    out = _box(d, xc, 1.3, w, 0.75, "output " + shape(lead, "L", L, "d_v", d_v))
    _arrow(d, (xc, boxes[4].y - boxes[4].h / 2), (xc, out.y + out.h / 2))
    return _finish(d)


# ---------------------------------------------------------------------------------------------
# Chapter 6: multi-head attention


def multihead_diagram(mha: MultiHeadAttention, x: Tensor, *, ax: Optional[Axes] = None) -> Figure:
    """Self-attention of ``mha``, a ``MultiHeadAttention``, on ``x`` ``(B, T, d_model)``, top to
    bottom: the three projections, the split of the features into heads (a view, then a
    transpose), attention in every head at once, the merge and ``out_proj``. The shapes are
    those of the tensors that ``mha``'s own modules and methods return on ``x`` (``q_proj``,
    ``split_heads``, ``merge_heads``, the forward pass), computed here without gradients."""
    _check_type(mha, MultiHeadAttention, "multihead_diagram",
                "a MultiHeadAttention of code/attention.py")
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != mha.d_model:
        raise ValueError(f"multihead_diagram needs x of shape (B, T, d_model) with "
                         f"d_model={mha.d_model}; got {_describe(x)}")
    H, G, d_h, D = mha.num_heads, mha.num_kv_heads, mha.head_dim, mha.d_model
    with torch.no_grad():
        projected = [p(x) for p in (mha.q_proj, mha.k_proj, mha.v_proj)]  # (B, T, D or G*d_h)
        viewed = [t.view(*t.shape[:2], -1, d_h) for t in projected]  # split_heads' view
        heads = [mha.split_heads(t) for t in projected]  # (B, H, T, d_h), (B, G, T, d_h) twice
        attended, _ = scaled_dot_product_attention(  # what the forward pass computes inside
            heads[0], *(repeat_kv(t, H // G) for t in heads[1:]))
        merged = mha.merge_heads(attended)  # (B, T, D)
        out, weights = mha(x, x, x)
    gqa = G != H
    kv = "G" if gqa else "H"  # the letter of the key-value heads

    def shapes(q_shape, kv_shape, letters_q, letters_kv):
        if not gqa:
            return "q, k, v: " + _named(letters_q, q_shape)
        return f"q: {_named(letters_q, q_shape)}\nk, v: {_named(letters_kv, kv_shape)}"

    d = _canvas(ax)
    cols = [1.8, 4.9, 8.0]  # q, k, v
    right = 9.9  # where the shapes are written
    rows = {"x": 14.0, "proj": 12.3, "view": 10.5, "transpose": 8.7, "attn": 6.4,
            "merge": 4.1, "out": 2.4}
    _box(d, cols[1], rows["x"], 9.0, 0.75, "x, the input sequence (self-attention: q, k, v "
         "all from x)", size=SMALL)
    d.text(right, rows["x"], "x: " + _named(["B", "T", "d_model"], _shape(x)), ha="left")
    for col, name in zip(cols, "qkv"):
        letter = "H" if name == "q" else kv
        _arrow(d, (col, rows["x"] - 0.375), (col, rows["proj"] + 0.45))
        _box(d, col, rows["proj"], 2.8, 0.9, f"{name}_proj: Linear", "linear", size=SMALL)
        _arrow(d, (col, rows["proj"] - 0.45), (col, rows["view"] + 0.45))
        _box(d, col, rows["view"], 2.8, 0.9, f".view(B, T, {letter}, d_h)", "linear", size=SMALL)
        _arrow(d, (col, rows["view"] - 0.45), (col, rows["transpose"] + 0.45))
        _box(d, col, rows["transpose"], 2.8, 0.9, ".transpose(1, 2)", "linear", size=SMALL)
        _arrow(d, (col, rows["transpose"] - 0.45), (col, rows["attn"] + 1.1))
    d.text(right, rows["proj"], shapes(_shape(projected[0]), _shape(projected[1]),
                                       ["B", "T", "d_model"], ["B", "T", "G·d_h"]), ha="left")
    d.text(right, rows["view"], shapes(_shape(viewed[0]), _shape(viewed[1]),
                                       ["B", "T", "H", "d_h"], ["B", "T", "G", "d_h"]), ha="left")
    d.text(right, rows["transpose"], shapes(_shape(heads[0]), _shape(heads[1]),
                                            ["B", "H", "T", "d_h"], ["B", "G", "T", "d_h"]),
           ha="left")
    # Attention in every head at once: one box per head (at most eight drawn).
    frame_w, frame_h = 9.0, 2.2
    _frame(d, cols[1] - frame_w / 2, rows["attn"] - frame_h / 2, cols[1] + frame_w / 2,
           rows["attn"] + frame_h / 2)
    d.text(cols[1], rows["attn"] + 0.65, "attention in every head at once: "
           "softmax($qk^\\top/\\sqrt{d_h}$)$\\,v$")
    shown = list(range(H)) if H <= 8 else [0, 1, 2, None, H - 1]
    hw = min(1.7, (frame_w - 0.6) / len(shown) - 0.15)
    for i, h in enumerate(shown):
        hx = cols[1] + (i - (len(shown) - 1) / 2) * (hw + 0.15)
        if h is None:
            d.text(hx, rows["attn"] - 0.3, "...", size=FONT)
            continue
        label = f"head {h + 1}" + (f"\nkv head {h // (H // G) + 1}" if gqa else "")
        _box(d, hx, rows["attn"] - 0.3, hw, 0.95 if gqa else 0.7, label, "attention", size=SMALL)
    d.text(right, rows["attn"], "heads: " + _named(["B", "H", "T", "d_h"], _shape(attended))
           + "\nweights: " + _named(["B", "H", "T", "T"], _shape(weights)), ha="left")
    _arrow(d, (cols[1], rows["attn"] - frame_h / 2), (cols[1], rows["merge"] + 0.45))
    _box(d, cols[1], rows["merge"], 9.0, 0.9, "merge_heads: .transpose(1, 2), "
         ".reshape(B, T, H·d_h)", "linear", size=SMALL)
    d.text(right, rows["merge"], "merged: " + _named(["B", "T", "H·d_h"], _shape(merged)),
           ha="left")
    _arrow(d, (cols[1], rows["merge"] - 0.45), (cols[1], rows["out"] + 0.45))
    _box(d, cols[1], rows["out"], 9.0, 0.9, "out_proj: Linear, mixes the heads", "linear",
         size=SMALL)
    d.text(right, rows["out"], "output: " + _named(["B", "T", "d_model"], _shape(out)), ha="left")
    d.text(right, 0.9, f"H = {H} heads" + (f", G = {G} key-value heads" if gqa else "")
           + f"\nd_h = d_model / H = {D} / {H} = {d_h}", ha="left")
    return _finish(d)


# ---------------------------------------------------------------------------------------------
# Chapter 7: cross-attention and the encoder-decoder Transformer


def _grid(d: Drawing, x, y_top, rows: int, cols: int, kind: str, cell: float, cap: int = 12):
    """A rows x cols grid of cells with its top-left corner at (x, y_top), one cell per entry
    (at most ``cap`` a side drawn). Returns its width and height."""
    r, c = min(rows, cap), min(cols, cap)
    for i in range(r):
        for j in range(c):
            _cell(d, x + j * cell, y_top - (i + 1) * cell, cell, cell, kind, lw=0.6)
    return c * cell, r * cell


def cross_attention_diagram(x_dec: Tensor, x_enc: Tensor, q: Tensor, k: Tensor, v: Tensor, *,
                            ax: Optional[Axes] = None) -> Figure:
    """Cross-attention drawn as matrices, one cell per entry: the decoder stream ``x_dec`` ``(L,
    d_dec)`` gives the queries ``q`` ``(L, d_k)``; the encoder output ``x_enc`` ``(S, d_enc)``
    gives the keys ``k`` ``(S, d_k)``, drawn transposed above the weights, and the values
    ``v`` ``(S, d_v)``; the weights are ``L x S``, one row per decoder position, and the
    output ``L x d_v``. The tensors are 2-D (one sequence), with q's rows those of x_dec and
    k's and v's those of x_enc; at most twelve cells a side are drawn."""
    for name, t in (("x_dec", x_dec), ("x_enc", x_enc), ("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 2:
            raise ValueError(f"cross_attention_diagram draws one sequence: {name} must be a 2-D "
                             f"tensor (rows, width); got {_describe(t)}")
    _check_qkv(q, k, v)
    L, S = x_dec.shape[0], x_enc.shape[0]
    if q.shape[0] != L or k.shape[0] != S:
        raise ValueError(f"the queries come from the decoder, the keys and values from the "
                         f"encoder: q needs x_dec's {L} rows, k and v x_enc's {S}; got x_dec "
                         f"{_shape(x_dec)}, x_enc {_shape(x_enc)}, q {_shape(q)}, "
                         f"k {_shape(k)}, v {_shape(v)}")
    d_dec, d_enc, d_k, d_v = x_dec.shape[1], x_enc.shape[1], q.shape[1], v.shape[1]
    c = 0.36  # the side of a cell
    d = _canvas(ax)
    # The decoder's row, L rows all along: X_dec, Q, the weights A, the output.
    top = 4.0  # their top edge
    x = 0.5
    tops = {}
    for name, cols, kind, label, gap in (
            ("dec", d_dec, "attention", "decoder stream $X_{dec}$\n"
             + _named(["L", "d_dec"], (L, d_dec)), 1.9),
            ("q", d_k, "attention", "queries $Q$\n" + _named(["L", "d_k"], (L, d_k)), 2.0),
            ("a", S, "softmax", "weights $A$\n" + _named(["L", "S"], (L, S)), 1.9),
            ("out", d_v, "attention", "output $AV$\n" + _named(["L", "d_v"], (L, d_v)), 0)):
        w, h = _grid(d, x, top, L, cols, kind, c)
        d.text(x + w / 2, top - h - 0.15, label, va="top")
        tops[name] = (x, w, h)
        x += w + gap
    (xdec, wdec, hdec), (xq, wq, hq), (xa, wa, ha), (xo, wo, ho) = tops.values()
    for (x0, w0, _), (x1, _, _), label in zip(list(tops.values()), list(tops.values())[1:],
                                              ("$W_Q$", "", "")):
        _arrow(d, (x0 + w0 + 0.08, top - ha / 2), (x1 - 0.04, top - ha / 2), label,
               side="above", offset=0.08)
    # The encoder's side: K^T over the weights (a column per key), V over the output.
    y_k = top + 1.0 + min(d_k, 12) * c  # top edge of K^T
    wk, hk = _grid(d, xa, y_k, d_k, S, "mlp", c)
    y_v = top + 1.0 + min(S, 12) * c  # top edge of V
    wv, hv = _grid(d, xo, y_v, S, d_v, "mlp", c)
    d.text(xa - 0.2, y_k - hk / 2, "keys, transposed: $K^\\top$\n"
           + _named(["d_k", "S"], (d_k, S)), ha="right")
    d.text(xo + wv + 0.2, y_v - hv / 2, "values $V$\n" + _named(["S", "d_v"], (S, d_v)),
           ha="left")
    _arrow(d, (xa + wa / 2, y_k - hk - 0.08), (xa + wa / 2, top + 0.05))
    _arrow(d, (xo + wo / 2, y_v - hv - 0.08), (xo + wo / 2, top + 0.05))
    y_in = max(y_k, y_v) + 1.6 + min(S, 12) * c  # top edge of X_enc
    x_in = (xa + wa / 2 + xo + wv / 2) / 2 - min(d_enc, 12) * c / 2
    we, he = _grid(d, x_in, y_in, S, d_enc, "mlp", c)
    d.text(x_in + we / 2, y_in + 0.15, "encoder output $X_{enc}$\n"
           + _named(["S", "d_enc"], (S, d_enc)), va="bottom")
    _arrow(d, (x_in + we / 2, y_in - he - 0.1), (xa + wa / 2, y_k + 0.05), "$W_K$",
           side="left", offset=0.2)
    _arrow(d, (x_in + we / 2, y_in - he - 0.1), (xo + wv / 2, y_v + 0.05), "$W_V$", offset=0.2)
    d.text(xdec, top - max(hdec, 2 * c) - 1.1, "weights $A$ = softmax$(QK^\\top/\\sqrt{d_k})$ "
           "along each row:\none row per decoder position, one column per encoder position",
           ha="left", va="top")
    return _finish(d)


def _sublayers(d: Drawing, xs: float, y: float, sublayers: list, norm_first: bool, *,
               side: int = 1, branch_w: float = 4.0, gap: float = 0.6,
               norms: Sequence[str] = ("LayerNorm",) * 3) -> tuple[float, dict]:
    """The residual stream, the vertical line at x = xs, from height y up, with a branch for
    each sublayer (label, kind, height) to its right (side=1) or left (-1), in the order of
    ``norm_first``: pre-LN adds f(LN(x)) to x, the norm on the branch; post-LN takes
    LN(x + f(x)), the norm on the stream after the addition. Returns the height the stream
    reaches and each sublayer's box by its label."""
    xb = xs + side * (gap + branch_w / 2)
    drawn = {}
    for (label, kind, h), norm in zip(sublayers, norms):
        split = y + 0.3
        _dot(d, xs, split)
        _line(d, [xs, xb], [split, split])
        cursor = split
        if norm_first:
            ln = _box(d, xb, cursor + 0.75, min(branch_w, 3.2), 0.55, norm, "norm", size=SMALL)
            _arrow(d, (xb, cursor), (xb, ln.y - ln.h / 2))
            cursor = ln.y + ln.h / 2
        box = _box(d, xb, cursor + 0.45 + h / 2, branch_w, h, label, kind, size=SMALL)
        drawn[label] = box
        _arrow(d, (xb, cursor), (xb, box.y - h / 2))
        add = _plus(d, xs, box.y + h / 2 + 0.45)
        _line(d, [xb, xb], [box.y + h / 2, add.y])
        _arrow(d, (xb, add.y), (xs + side * add.w / 2, add.y))
        _line(d, [xs, xs], [y, add.y - add.h / 2], width=STREAM)
        y = add.y + add.h / 2
        if not norm_first:
            ln = _box(d, xs, y + 0.55, 2.6, 0.55, norm, "norm", size=SMALL)
            _line(d, [xs, xs], [y, ln.y - ln.h / 2], width=STREAM)
            y = ln.y + ln.h / 2
    return y, drawn


def _activation_name(activation) -> str:
    if activation is nn.functional.relu or isinstance(activation, nn.ReLU):
        return "ReLU"
    if activation is nn.functional.gelu or isinstance(activation, nn.GELU):
        return "GELU"
    return getattr(activation, "__name__", type(activation).__name__)


def _stack_end(d: Drawing, x, top, norm: bool) -> float:
    """The stream leaving a stack at ``top``, through the stack's final LayerNorm if it has
    one; returns the height where the stream continues."""
    y = top + 0.95
    _line(d, [x, x], [top, y], width=STREAM)
    if norm:
        ln = _box(d, x, y + 0.5, 2.6, 0.55, "LayerNorm", "norm", size=SMALL)
        _line(d, [x, x], [y, ln.y - ln.h / 2], width=STREAM)
        y = ln.y + ln.h / 2
    return y


def encoder_decoder_diagram(model: nn.Transformer, *, n_vocab: Optional[int] = None,
                            ax: Optional[Axes] = None) -> Figure:
    """The encoder-decoder Transformer of ``model``, a ``torch.nn.Transformer``, bottom to top.
    Left, the encoder: token embeddings and positions, then N blocks of self-attention and an
    MLP. Right, the decoder: N blocks of masked self-attention, cross-attention reading the
    encoder's output, and an MLP; then a linear map to the vocabulary and a softmax. One block
    of each stack is drawn, with its count. The widths, the heads, the counts, the order of
    the norms and the final norms are read from ``model``'s layers; ``n_vocab``, which
    ``nn.Transformer`` does not hold (nor the embeddings), is written as a letter without it."""
    _check_type(model, nn.Transformer, "encoder_decoder_diagram", "a torch.nn.Transformer")
    if n_vocab is not None and (isinstance(n_vocab, bool) or not isinstance(n_vocab, int)
                                or n_vocab < 1):
        raise ValueError(f"n_vocab must be a positive integer or None, got {n_vocab!r}")
    enc, dec = model.encoder, model.decoder
    first = enc.layers[0]
    D, H = first.self_attn.embed_dim, first.self_attn.num_heads
    d_ff = first.linear1.out_features
    pre = first.norm_first
    act = _activation_name(first.activation)
    vocab = "n_vocab" if n_vocab is None else str(n_vocab)
    d = _canvas(ax)
    branch = 3.6  # the width of a sublayer's box
    xe = 1.4  # the encoder's residual stream; its branches to the right
    xd = xe + 2 * (0.6 + branch) + 2.0  # the decoder's; its branches to the left
    mlp = (f"MLP: Linear {D} → {d_ff},\n{act}, Linear {d_ff} → {D}", "mlp", 0.8)
    heads = f"H = {H} heads"
    for xs, name, length, side in ((xe, "source", "S", -1), (xd, "target", "L", 1)):
        tokens = _box(d, xs, 0.35, 3.8, 0.7, f"{name} tokens (B, {length})", size=SMALL)
        emb = _box(d, xs, 1.55, 3.8, 0.9, "token embedding\n+ positions", "linear", size=SMALL)
        _arrow(d, (xs, tokens.y + 0.35), (xs, emb.y - 0.45))
        _line(d, [xs, xs], [emb.y + 0.45, 2.9], width=STREAM)
        d.text(xs + side * 0.15, 2.45, f"(B, {length}, d_model)", ha="left" if side == 1
               else "right")
    enc_top, _ = _sublayers(d, xe, 2.9, [(f"self-attention\n{heads}", "attention", 0.8), mlp],
                            pre, side=1, branch_w=branch)
    subs = [(f"masked self-attention\n{heads}", "attention", 0.8),
            (f"cross-attention\n{heads}", "attention", 0.8), mlp]
    dec_top, dec_boxes = _sublayers(d, xd, 2.9, subs, pre, side=-1, branch_w=branch)
    # Each stack's block in a frame with its count, inside the frame's top corner.
    for xs, top, side, n, name in ((xe, enc_top, 1, len(enc.layers), "encoder"),
                                   (xd, dec_top, -1, len(dec.layers), "decoder")):
        inner, outer = xs - side * 1.5, xs + side * (branch + 0.8)
        x0, x1 = min(inner, outer), max(inner, outer)
        _frame(d, x0, 2.75, x1, top + 0.75)
        d.text(outer - side * 0.15, top + 0.6, f"{name} block × {n}", ha="right" if side == 1
               else "left", va="top", weight="bold")
    # The final norms (an nn.Transformer has one after each stack) and the encoder's output.
    y = _stack_end(d, xe, enc_top, enc.norm is not None)
    cross = dec_boxes[subs[1][0]]
    x_route = (xe + xd) / 2
    y_route = y + 0.5
    _line(d, [xe, xe, x_route, x_route], [y, y_route, y_route, cross.y])
    _arrow(d, (x_route, cross.y), (cross.x - cross.w / 2, cross.y), "K, V", side="above",
           offset=0.1)
    d.text(xe - 0.2, y_route + 0.15, "encoder output (B, S, d_model): the keys and\nvalues of "
           "every decoder block's cross-attention", ha="left", va="bottom")
    y = _stack_end(d, xd, dec_top, dec.norm is not None)
    lin = _box(d, xd, y + 0.95, 4.4, 0.9, f"Linear d_model → n_vocab\n({D} → {vocab})",
               "linear", size=SMALL)
    _arrow(d, (xd, y), (xd, lin.y - 0.45))
    soft = _box(d, xd, lin.y + 1.25, 4.4, 0.65, "softmax over the vocabulary", "softmax",
                size=SMALL)
    _arrow(d, (xd, lin.y + 0.45), (xd, soft.y - soft.h / 2))
    d.text(xd, soft.y + 0.45, f"next-token probabilities (B, L, {vocab})", va="bottom")
    d.text(xe - 1.5, soft.y + 0.9, ("pre-LN: x + f(LN(x))" if pre else "post-LN: LN(x + f(x))")
           + f"\nd_model = {D}, d_ff = {d_ff}", ha="left", va="top")
    return _finish(d)


# ---------------------------------------------------------------------------------------------
# Chapter 9: one decoding step with the key-value cache


def kv_cache_diagram(mha: MultiHeadAttention, cache: KVCache, x_new: Tensor, *,
                     ax: Optional[Axes] = None) -> Figure:
    """One decoding step of ``mha`` with ``cache``: the new token ``x_new`` ``(B, 1,
    d_model)`` is projected to q, k and v; k and v are appended to the cached keys and
    values; q attends over every key the cache then gives it. The step runs on copies of
    ``cache``, which is left as it is: the shapes drawn are the copy's keys before and after,
    the step's projections, weights and output, and the keys q sees are those
    ``KVCache.update`` lets it see (with a window, the older ones are hatched)."""
    _check_type(mha, MultiHeadAttention, "kv_cache_diagram",
                "a MultiHeadAttention of code/attention.py")
    _check_type(cache, KVCache, "kv_cache_diagram", "a KVCache of code/attention.py")
    if not isinstance(x_new, Tensor) or x_new.dim() != 3 or x_new.shape[1] != 1 \
            or x_new.shape[2] != mha.d_model:
        raise ValueError(f"kv_cache_diagram draws one decoding step: x_new must hold one new "
                         f"position, (B, 1, d_model) with d_model={mha.d_model}; got "
                         f"{_describe(x_new)}")
    if len(cache) == 0:
        raise ValueError("kv_cache_diagram draws a step after the prompt, but the cache is "
                         "empty: run the prompt through mha with this cache first")
    before = _shape(cache.keys)
    position = cache.seen  # of the new token, 0-based
    with torch.no_grad():
        q = mha.split_heads(mha.q_proj(x_new))  # (B, H, 1, d_h)
        k = mha.split_heads(mha.k_proj(x_new))  # (B, G, 1, d_h)
        v = mha.split_heads(mha.v_proj(x_new))  # (B, G, 1, d_h)
        probe = copy.deepcopy(cache)
        _, _, visible = probe.update(k, v, is_causal=True)  # (1, S)
        step = copy.deepcopy(cache)
        out, weights = mha(x_new, x_new, x_new, is_causal=True, cache=step)
    after = _shape(step.keys)
    # the keys q is given, drawn in position order (a ring gives them in slot order, which
    # attention does not care about)
    order = torch.argsort(probe.key_positions)
    seen = probe.key_positions[order].tolist()
    visible = visible[:, order]
    H, G = mha.num_heads, mha.num_kv_heads
    kv = "G" if G != H else "H"

    d = _canvas(ax)
    cell = 0.62
    shown = seen if len(seen) <= 10 else seen[:3] + [None] + seen[-6:]
    x0 = 5.0  # the left edge of the caches
    x_new_cell = x0 + (len(shown) - 1) * cell + cell / 2  # centre of the new token's cells
    x_end = x0 + len(shown) * cell  # the right edge of the caches
    x_frame = (x0 - 2.0, max(x_end, x0 + 4.6) + 0.2)  # the frame around the caches
    x_v = max(x_frame[1] + 1.6, x_new_cell + 3.0)  # v: down beside the frame, into V
    y_k, y_v = 7.0, 5.2
    x_box = _box(d, x_new_cell - 1.0, 12.0, 5.6, 1.0, f"the new token, at position {position}\n"
                 + _named(["B", "1", "d_model"], _shape(x_new)), "new", size=SMALL)
    rows = 9.9
    proj = {}
    for name, t, letter, x in (("q", q, "H", 1.6), ("k", k, kv, x_new_cell),
                               ("v", v, kv, x_v)):
        proj[name] = _box(d, x, rows, 2.8, 1.3, f"{name}_proj → {name}\n"
                          + _named(["B", letter, "1", "d_h"], _shape(t)).replace(" = ", "\n= "),
                          "linear", size=SMALL)
        _line(d, [x_box.x, x_box.x, x], [x_box.y - 0.5, 11.1, 11.1])
        _arrow(d, (x, 11.1), (x, rows + 0.65))
    _dot(d, x_box.x, 11.1)
    for name, y in (("K", y_k), ("V", y_v)):
        for j, p in enumerate(shown):
            cx = x0 + j * cell
            if p is None:
                d.text(cx + cell / 2, y, "...", cell=True)
                continue
            new = p == position
            hidden = not new and not bool(visible[0, seen.index(p)])
            _cell(d, cx, y - cell / 2, cell, cell, "skipped" if hidden else "new" if new
                  else "cache", label=str(p), lw=1.6 if new else 0.7, size=SMALL - 1)
        d.text(x0 - 0.2, y, f"{name} cache", ha="right", size=FONT)
    _arrow(d, (x_new_cell, rows - 0.65), (x_new_cell, y_k + cell / 2), "append", offset=0.12)
    _line(d, [x_v, x_v], [rows - 0.65, y_v])
    d.text(x_v + 0.12, (rows - 0.65 + y_v) / 2, "append", ha="left")
    _arrow(d, (x_v, y_v), (x_end, y_v))
    grows = (f"grows to {_named(['B', kv, 'T+1', 'd_h'], after)}" if cache.window is None else
             f"keeps W = {cache.window} slots: {after};\nposition {position} overwrites "
             f"slot {position % cache.window}")
    d.text(x0 - 1.85, (y_k + y_v) / 2, "each cache " + _named(["B", kv, "T", "d_h"], before)
           + "\n" + grows, ha="left")
    y_note = y_v - cell / 2 - 0.15
    d.text(x0 - 1.85, y_note, "one cell per position, numbered from 0;\n"
           "the new token's cells outlined", ha="left", va="top")
    _frame(d, x_frame[0], y_note - 0.85, x_frame[1], y_k + cell / 2 + 0.25)
    attend = (f"q attends over all T+1 = {len(seen)} keys and values in the cache\nweights "
              + _named(["B", "H", "1", "T+1"], _shape(weights))) if cache.window is None else (
        f"q attends over the ring's {len(seen)} slots, positions {seen[0]} to {seen[-1]}\n"
        "weights " + _named(["B", "H", "1", "W"], _shape(weights)))
    attend += ("; no mask: the new token\nis the newest position, it may see every key"
               if bool(visible.all()) else f"; the {int(visible.sum())} inside the window"
               f"\nget weights, the older ones (grey) none")
    x_mid, width = (0.2 + x_v + 1.4) / 2, x_v + 1.2  # across the whole diagram
    att = _box(d, x_mid, 2.7, width, 1.4, attend, "attention", size=SMALL)
    _arrow(d, (proj["q"].x, rows - 0.65), (proj["q"].x, att.y + att.h / 2))
    _arrow(d, (sum(x_frame) / 2, y_note - 0.85), (sum(x_frame) / 2, att.y + att.h / 2))
    out_box = _box(d, x_mid, 1.0, width, 0.8, "heads merged, out_proj: output "
                   + _named(["B", "1", "d_model"], _shape(out)), "linear", size=SMALL)
    _arrow(d, (x_mid, att.y - att.h / 2), (x_mid, out_box.y + out_box.h / 2))
    return _finish(d)


# ---------------------------------------------------------------------------------------------
# Chapter 10: FlashAttention's tiles


def flash_tiles_diagram(q: Tensor, k: Tensor, v: Tensor, *, block_size: Optional[int] = None,
                        is_causal: bool = False, ax: Optional[Axes] = None) -> Figure:
    """The tiles in which ``flash_attention(q, k, v, block_size=..., is_causal=...)`` visits the
    ``L x S`` scores: query blocks down, key blocks across, each visited tile numbered in the
    order of the loops (``flash.visited_tiles``), the tiles a causal mask skips hatched, and
    beside it what stays in fast memory while one query block is processed. ``block_size``
    defaults to ``flash_attention``'s own default; L, S, d_k and d_v are read from q, k, v."""
    _check_qkv(q, k, v)
    if block_size is None:
        block_size = inspect.signature(flash_attention).parameters["block_size"].default
    L, d_k = q.shape[-2:]
    S, d_v = v.shape[-2:]
    order = visited_tiles(L, S, block_size, is_causal)  # raises on a bad block_size
    n_L, n_S = math.ceil(L / block_size), math.ceil(S / block_size)
    if max(n_L, n_S) > 12 or min(L, S) == 0:
        raise ValueError(f"flash_tiles_diagram draws 1 to 12 blocks a side; L={L}, S={S} with "
                         f"block_size={block_size} give {n_L} x {n_S}")
    r = c = block_size
    unit = 7.5 / max(L, S)  # data units per query or key
    d = _canvas(ax)
    x0, y0 = 1.4, 9.0  # the top-left corner of the scores
    number = {tile: n + 1 for n, tile in enumerate(order)}
    for I in range(n_L):
        for J in range(n_S):
            h, w = min(r, L - I * r) * unit, min(c, S - J * c) * unit
            x, y = x0 + J * c * unit, y0 - I * r * unit - h
            visited = (I, J) in number
            crossed = is_causal and visited and (J + 1) * c - 1 > I * r  # the diagonal cuts it
            kind = "mask" if crossed else "attention" if visited else "skipped"
            _cell(d, x, y, w, h, kind, hatch=None if visited else "//", lw=0.8)
            if visited and min(w, h) >= 0.5:  # where the diagonal cuts a tile: below it
                d.text(x + w * (0.3 if crossed else 0.5), y + h * (0.3 if crossed else 0.5),
                       str(number[(I, J)]), size=FONT, cell=True)
    if is_causal:
        _line(d, [x0, x0 + min(L, S) * unit], [y0, y0 - min(L, S) * unit], width=1.4,
              zorder=3)
    last = lambda n, b: f" (the last {n - (math.ceil(n / b) - 1) * b})" if n % b else ""  # noqa
    d.text(x0 + S * unit / 2, y0 + 0.2, f"keys: S = {S}, in {n_S} blocks of c = {c}"
           + last(S, c), va="bottom")
    d.text(x0 - 0.2, y0 - L * unit / 2, f"queries: L = {L},\nin {n_L} blocks of r = {r}"
           + last(L, r), ha="right", rotation=90)
    d.text(x0, y0 - L * unit - 0.2, "numbers: the order the loops visit the tiles.\nOuter loop: "
           "the query blocks, top to bottom;\ninner loop: the key blocks, left to right."
           + ("\nOrange: cut by the diagonal, masked inside.\nHatched: skipped, wholly "
              "above the diagonal." if is_causal else ""), ha="left", va="top")
    xm, w_mem = x0 + 7.5 + 3.3, 5.0  # fast memory, for the current query block
    items = [(f"queries Q {_named(['r', 'd_k'], (r, d_k))}", "linear"),
             (f"running max m {_named(['r'], (r,))}", "norm"),
             (f"running sum ℓ {_named(['r'], (r,))}", "norm"),
             (f"accumulator ỹ {_named(['r', 'd_v'], (r, d_v))}", "norm"),
             (f"one key block at a time:\nkeys {_named(['c', 'd_k'], (c, d_k))}\n"
              f"values {_named(['c', 'd_v'], (c, d_v))}", "mlp"),
             (f"scores of one tile {_named(['r', 'c'], (r, c))}", "io")]
    y = y0 - 0.9
    for text, kind in items:
        h = 0.3 + 0.32 * (text.count("\n") + 1)
        _box(d, xm, y - h / 2, w_mem, h, text, kind, size=SMALL)
        y -= h + 0.2
    _frame(d, xm - w_mem / 2 - 0.2, y - 0.05, xm + w_mem / 2 + 0.2, y0 + 0.3)
    # One query block, outlined, is what the memory holds.
    I = min(1, n_L - 1)
    y_row = y0 - min(L, (I + 1) * r) * unit
    outline = Rectangle((x0, y_row), S * unit, min(r, L - I * r) * unit, facecolor="none",
                        edgecolor=INK, linewidth=2.4, zorder=4)
    d.ax.add_patch(outline)
    d.frames.append(outline)
    y_link = y_row + min(r, L - I * r) * unit / 2
    _line(d, [x0 + S * unit, xm - w_mem / 2 - 0.2], [y_link, y_link], dashed=True)
    d.text(xm, y0 - 0.3, "fast memory (on a GPU, SRAM),\nfor one query block:", weight="bold")
    d.text(xm, y - 0.3, "slow memory: Q, K, V, the output\nand one log-sum-exp per query",
           va="top")
    return _finish(d)


# ---------------------------------------------------------------------------------------------
# The Transformer block and a decoder-only model (code/transformer.py)


BLOCK_LIMITS = (0.25, 0.0, 8.95, 10.9)  # block_diagram's canvas, the same for either order
BLOCK_FIGSIZE = ((BLOCK_LIMITS[2] - BLOCK_LIMITS[0]) * UNIT,  # inches: one block, full size
                 (BLOCK_LIMITS[3] - BLOCK_LIMITS[1]) * UNIT)


def _mlp_label(block: TransformerBlock) -> str:
    """The MLP of ``block``: its two linear maps, with the widths they really have, and the
    activation between them (SwiGLU's first map is twice as wide)."""
    one, two = block.linear1, block.linear2
    wide = "2·d_ff" if block.activation == "swiglu" else "d_ff"
    act = {"relu": "ReLU", "gelu": "GELU", "swiglu": "SwiGLU: silu(gate) · value"}[
        block.activation]
    return (f"MLP: Linear d_model → {wide} ({one.in_features} → {one.out_features})\n{act}\n"
            f"Linear d_ff → d_model ({two.in_features} → {two.out_features})")


def _attention_label(block: TransformerBlock, causal: bool) -> str:
    attn = block.self_attn
    return (f"{'causal ' if causal else ''}multi-head self-attention\n"
            f"H = {attn.num_heads} heads of d_h = {attn.head_dim}")


def _block_body(d: Drawing, block: TransformerBlock, causal: bool, xs: float, y: float) -> tuple:
    """The block's residual stream at x = xs from height y, its two branches to the right, in
    the block's order; returns the stream's top and the sublayers' boxes."""
    subs = [(_attention_label(block, causal), "attention", 0.95),
            (_mlp_label(block), "mlp", 1.35)]
    return _sublayers(d, xs, y, subs, block.norm_first, side=1, branch_w=6.0, gap=0.5,
                      norms=("LayerNorm LN1", "LayerNorm LN2"))


def block_diagram(block: TransformerBlock, *, causal: bool = False,
                  ax: Optional[Axes] = None) -> Figure:
    """One ``TransformerBlock`` of code/transformer.py in its real order, bottom to top. The
    residual stream is the vertical line; each branch reads from it and adds back into it.
    pre-LN (``norm_first=True``): x + Attn(LN1(x)), then x + MLP(LN2(x)); post-LN: LN1(x +
    Attn(x)), then LN2(x + MLP(x)), the norms on the stream. The widths d_model and d_ff, the
    heads and the activation are the block's; ``causal`` says the attention is causal (the
    block takes its mask when called). Both orders have the same canvas, so two blocks side
    by side line up, at full size in ``fig, axes = plt.subplots(1, 2, figsize=(2 *
    BLOCK_FIGSIZE[0], BLOCK_FIGSIZE[1]), gridspec_kw=dict(left=0, right=1, bottom=0, top=1,
    wspace=0))``, then ``block_diagram(b, ax=a)`` for each (in a smaller Axes, smaller)."""
    _check_type(block, TransformerBlock, "block_diagram",
                "a TransformerBlock of code/transformer.py")
    d = _canvas(ax)
    xs = 2.2  # the residual stream
    x_in = _box(d, xs + 1.3, 0.5, 5.6, 0.7, f"x (B, T, d_model), d_model = {block.d_model}",
                size=SMALL)
    _line(d, [xs, xs], [x_in.y + x_in.h / 2, 1.4], width=STREAM)
    top, _ = _block_body(d, block, causal, xs, 1.4)
    _line(d, [xs, xs], [top, top + 0.4], width=STREAM)
    out = _box(d, xs + 1.3, top + 0.75, 5.6, 0.7, "output (B, T, d_model)", size=SMALL)
    d.text(xs - 1.55, (1.4 + top) / 2, f"residual stream, width d_model = {block.d_model}",
           rotation=90)
    order = ("pre-LN (norm_first=True)\nx + Attn(LN1(x)); x + MLP(LN2(x))" if block.norm_first
             else "post-LN (norm_first=False)\nLN1(x + Attn(x)); LN2(x + MLP(x))")
    d.text(xs + 2.4, out.y + 0.6, order, size=FONT, va="bottom", weight="bold")
    return _finish(d, limits=BLOCK_LIMITS)


def decoder_only_diagram(blocks: Sequence[TransformerBlock], n_vocab: int, *, tied: bool = True,
                         position: str = "position embedding",
                         ax: Optional[Axes] = None) -> Figure:
    """A decoder-only language model, bottom to top: the token embedding plus ``position``
    (a label), the TransformerBlocks of ``blocks`` (one drawn in full, with their count), all
    with causal self-attention, a final LayerNorm when the blocks are pre-LN, a linear map to
    the ``n_vocab`` logits (its weights tied to the token embedding when ``tied``) and a
    softmax. The widths, heads, activation and order of the norms are read from the blocks,
    which must agree in them."""
    if isinstance(blocks, nn.Module) and not isinstance(blocks, nn.ModuleList) \
            or not isinstance(blocks, (Sequence, nn.ModuleList)):
        raise TypeError(f"decoder_only_diagram needs a sequence of TransformerBlocks (a list "
                        f"or an nn.ModuleList); got {type(blocks).__name__}")
    blocks = list(blocks)
    if not blocks:
        raise ValueError("decoder_only_diagram needs at least one block")
    for i, block in enumerate(blocks):
        _check_type(block, TransformerBlock, f"decoder_only_diagram (block {i})",
                    "TransformerBlocks of code/transformer.py")
    config = lambda b: (b.d_model, b.num_heads, b.d_ff, b.norm_first, b.activation)  # noqa: E731
    differ = [i for i, b in enumerate(blocks) if config(b) != config(blocks[0])]
    if differ:
        raise ValueError(f"the blocks must agree in (d_model, num_heads, d_ff, norm_first, "
                         f"activation): block 0 has {config(blocks[0])}, block {differ[0]} "
                         f"{config(blocks[differ[0]])}")
    if isinstance(n_vocab, bool) or not isinstance(n_vocab, int) or n_vocab < 1:
        raise ValueError(f"n_vocab must be a positive integer, got {n_vocab!r}")
    if not isinstance(position, str):
        raise TypeError(f"position is a label, got {type(position).__name__}")
    block = blocks[0]
    D, pre = block.d_model, block.norm_first
    d = _canvas(ax)
    xs = 2.2  # the residual stream
    tokens = _box(d, xs, 0.35, 3.6, 0.7, "tokens (B, T)", size=SMALL)
    emb = _box(d, xs, 1.6, 5.2, 0.9, f"token embedding\nn_vocab × d_model = {n_vocab} × {D}",
               "linear", size=SMALL)
    _arrow(d, (xs, tokens.y + 0.35), (xs, emb.y - 0.45))
    add = _plus(d, xs, 2.75)
    _arrow(d, (xs, emb.y + 0.45), (xs, add.y - add.h / 2))
    pos = _box(d, xs + 4.2, add.y, 3.4, 0.65, position, "linear", size=SMALL)
    _arrow(d, (pos.x - pos.w / 2, pos.y), (xs + add.w / 2, add.y))
    d.text(xs + 0.2, add.y + 0.52, f"(B, T, d_model), d_model = {D}", ha="left")
    _line(d, [xs, xs], [add.y + add.h / 2, 3.8], width=STREAM)
    top, _ = _block_body(d, block, True, xs, 3.8)
    _frame(d, xs - 1.5, 3.55, xs + 6.8, top + 0.75)
    d.text(xs + 6.65, top + 0.6, f"block × {len(blocks)}", ha="right", va="top", weight="bold")
    _line(d, [xs, xs], [top, top + 1.1], width=STREAM)
    y = top + 1.1
    if pre:
        ln = _box(d, xs, y + 0.5, 2.8, 0.55, "final LayerNorm", "norm", size=SMALL)
        _line(d, [xs, xs], [y, ln.y - ln.h / 2], width=STREAM)
        y = ln.y + ln.h / 2
    head = _box(d, xs + 1.0, y + 0.95, 5.8, 0.9, f"Linear d_model → n_vocab ({D} → {n_vocab})"
                + ("\nits weights: the token embedding's" if tied else ""), "linear", size=SMALL)
    _arrow(d, (xs, y), (xs, head.y - head.h / 2))
    soft = _box(d, head.x, head.y + 1.2, 5.8, 0.65, "softmax over the vocabulary", "softmax",
                size=SMALL)
    _arrow(d, (xs, head.y + head.h / 2), (xs, soft.y - soft.h / 2))
    d.text(head.x, soft.y + 0.45, f"next-token probabilities (B, T, {n_vocab})", va="bottom")
    if tied:  # one matrix: a dashed line from the embedding to the output map
        xl = emb.x - emb.w / 2 - 0.4
        _line(d, [emb.x - emb.w / 2, xl, xl, head.x - head.w / 2], [emb.y, emb.y, head.y,
                                                                  head.y], dashed=True)
        d.text(xl - 0.15, (emb.y + head.y) / 2, "tied: one matrix, used twice", rotation=90,
               ha="right")
    return _finish(d)


# ---------------------------------------------------------------------------------------------
# Chapter 12: induction heads


def _arc(d: Drawing, start, end, rad: float):
    """An arrow from ``start`` to ``end`` along an arc bulging ``rad`` times their distance
    (negative: above a left-to-right arrow); returns its apex."""
    arrow = FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, linewidth=1.1,
                            color=INK, shrinkA=0, shrinkB=0, zorder=3,
                            connectionstyle=f"arc3,rad={rad}")
    d.ax.add_patch(arrow)
    d.lines.append(arrow)
    (x0, y0), (x1, y1) = start, end
    apex = ((x0 + x1) / 2 + rad * (y1 - y0) / 2, (y0 + y1) / 2 - rad * (x1 - x0) / 2)
    d.cover(x0, y0, x1, y1)
    d.cover(*apex, *apex)
    return apex


def induction_circuit_diagram(tokens, previous: Tensor, induction: Tensor, query: int, *,
                              labels: Optional[Sequence[str]] = None, prediction=None,
                              ax: Optional[Axes] = None) -> Figure:
    """An induction circuit at work on one sequence, drawn from its two heads' real attention
    weights: the tokens at positions 0..``query`` as a row of cells (their positions under
    them); the key j that the induction head's query at ``query`` weighs most, as an arc from j
    to the query; the key k that the previous-token head at j weighs most, as an arc from k to
    j; and, given, the model's ``prediction`` at the query. ``previous`` and ``induction`` are
    the ``(T, T)`` weights of the two heads on ``tokens`` ``(T,)``; ``labels`` (T strings)
    name the tokens, by default their numbers. The arcs point from the key read to the query
    that reads it, and each says its weight."""
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 1 or tokens.is_floating_point():
        raise ValueError(f"tokens must be a 1-D integer tensor (T,); got {_describe(tokens)}")
    T = tokens.shape[0]
    for name, w in (("previous", previous), ("induction", induction)):
        if not isinstance(w, Tensor) or tuple(w.shape) != (T, T):
            raise ValueError(f"{name} must be the (T, T) = ({T}, {T}) weights of one head on "
                             f"the {T} tokens; got {_describe(w)}")
    if isinstance(query, bool) or not isinstance(query, int) or not 2 <= query < T:
        raise ValueError(f"query must be a position in 2..{T - 1}, got {query!r}")
    labels = [str(int(t)) for t in tokens] if labels is None else [str(x) for x in labels]
    if len(labels) != T:
        raise ValueError(f"labels must name the {T} tokens; got {len(labels)}")
    j = int(induction[query, :query + 1].argmax())  # the key the induction head reads most
    k = int(previous[j, :j + 1].argmax())  # the key the previous-token head at j reads most
    a1, a0 = float(induction[query, j]), float(previous[j, k])
    d = _canvas(ax)
    w, h = 0.5, 0.8  # a cell: the token above, its position below
    kinds = {query: "new", j: "attention", k: "linear"}
    for p in range(query + 1):
        _cell(d, p * w, 0, w, h, kinds.get(p, "io"))
        d.text(p * w + w / 2, 0.53, labels[p], size=SMALL - 1, cell=True)
        d.text(p * w + w / 2, 0.2, str(p), size=SMALL - 2.5, cell=True)
    d.text(-0.1, 0.53, "token", ha="right", size=SMALL - 1)
    d.text(-0.1, 0.2, "position", ha="right", size=SMALL - 2.5)
    centre = lambda p: p * w + w / 2  # noqa: E731
    top = h
    if j != query:  # above the row: the query reads key j
        apex = _arc(d, (centre(j), h), (centre(query), h), -min(0.6, 1.8 / ((query - j) * w)))
        top = apex[1]
        d.text(0, top + 0.2, f"layer 1, induction head: position {query}, token "
               f"{labels[query]}, reads position {j} (weight {a1:.2f}),\nwhose previous "
               f"token is {labels[k]}, and copies the token there, {labels[j]}",
               ha="left", va="bottom")
    if k != j:  # below the row: position j reads key k
        low = _arc(d, (centre(k), 0), (centre(j), 0), 0.9)
        d.text(0, low[1] - 0.2, f"layer 0, previous-token head: position {j} reads position "
               f"{k} (weight {a0:.2f}), the token before it,\n{labels[k]}, and writes it "
               f"into position {j}", ha="left", va="top")
    if prediction is not None:
        box = _box(d, (query + 1) * w + 1.45, h / 2, 1.9, 0.75, f"prediction\nat {query}: "
                   f"{prediction}", "softmax", size=SMALL)
        _arrow(d, ((query + 1) * w, h / 2), (box.x - box.w / 2, h / 2))
    return _finish(d)

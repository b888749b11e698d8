"""code/diagrams.py: every label a diagram draws is read from the real objects, the blocks are
drawn in their real order, every diagram draws into a given Axes, bad input is refused with a
message that says why, and the layout holds: text inside its box, nothing overlapping, no
arrow into the void, nothing cut off, dark text on light fills."""

from __future__ import annotations

import inspect
import math
import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402
from torch import nn  # noqa: E402

import diagrams as dg  # noqa: E402
import numerics  # noqa: E402
from attention import KVCache, MultiHeadAttention, scaled_dot_product_attention  # noqa: E402
from flash import flash_attention, visited_tiles  # noqa: E402
from transformer import TransformerBlock  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def named(letters, sizes) -> str:
    """The shape label the diagrams write, built here independently of diagrams._named."""
    return "(" + ", ".join(letters) + ") = (" + ", ".join(str(int(n)) for n in sizes) + ")"


def labels(fig_or_ax) -> str:
    return "\n".join(dg.drawing(fig_or_ax).labels)


def transformer(d_model=32, nhead=4, n_enc=2, n_dec=3, d_ff=64, norm_first=False):
    with warnings.catch_warnings():  # nn.Transformer warns about nested tensors with norm_first
        warnings.simplefilter("ignore", UserWarning)
        return nn.Transformer(d_model, nhead, n_enc, n_dec, d_ff, batch_first=True,
                              norm_first=norm_first, device="meta")


def cached(mha, T, *, window=None, B=1, seed=0):
    """A cache that holds the first T positions of a random sequence, and the next token."""
    x = torch.randn(B, T + 1, mha.d_model, generator=gen(seed))
    cache = KVCache(window=window)
    with torch.no_grad():
        mha(x[:, :T], x[:, :T], x[:, :T], is_causal=True, cache=cache)
    return cache, x[:, T:]


# --- every diagram, as the tests below draw them --------------------------------------------------

def draw_all(ax_for=lambda: None):
    """(name, figure) of each diagram, each drawn into ax_for()."""
    g = gen(1)
    q, k, v = (torch.randn(n, w, generator=g) for n, w in ((4, 3), (6, 3), (6, 5)))
    mha = MultiHeadAttention(8, 2)
    cache, x_new = cached(MultiHeadAttention(16, 4), 5)
    yield "flow", dg.attention_flow_diagram(q, k, v, ax=ax_for())
    yield "multihead", dg.multihead_diagram(mha, torch.randn(2, 5, 8, generator=g), ax=ax_for())
    yield "cross", dg.cross_attention_diagram(torch.randn(3, 4, generator=g),
                                              torch.randn(5, 6, generator=g),
                                              torch.randn(3, 2, generator=g),
                                              torch.randn(5, 2, generator=g),
                                              torch.randn(5, 7, generator=g), ax=ax_for())
    yield "stack", dg.encoder_decoder_diagram(transformer(), n_vocab=100, ax=ax_for())
    yield "kv cache", dg.kv_cache_diagram(MultiHeadAttention(16, 4), cache, x_new, ax=ax_for())
    yield "flash", dg.flash_tiles_diagram(*(torch.randn(100, 4, generator=g) for _ in range(3)),
                                          block_size=32, is_causal=True, ax=ax_for())
    yield "block", dg.block_diagram(TransformerBlock(16, 4, 32), ax=ax_for())
    yield "decoder-only", dg.decoder_only_diagram([TransformerBlock(16, 4, 32)] * 2, 50,
                                                  ax=ax_for())
    yield "induction", dg.induction_circuit_diagram(*circuit(12, 9, 4), 9, prediction=5,
                                                    ax=ax_for())


# --- chapter 2: scaled dot-product attention ------------------------------------------------------

@pytest.mark.parametrize("lead", [(), (2,), (2, 3)], ids=["2-D", "batched", "heads"])
@pytest.mark.parametrize("L, S, d_k, d_v", [(4, 4, 3, 5), (2, 7, 6, 1), (9, 3, 2, 8)])
def test_attention_flow_labels_the_tensors_shapes(lead, L, S, d_k, d_v):
    g = gen(L * S)
    q = torch.randn(*lead, L, d_k, generator=g)
    k = torch.randn(*lead, S, d_k, generator=g)
    v = torch.randn(*lead, S, d_v, generator=g)
    out, weights = scaled_dot_product_attention(q, k, v)
    text = labels(dg.attention_flow_diagram(q, k, v))
    letters = {(): [], (2,): ["B"], (2, 3): ["B", "H"]}[lead]
    for name, t, last in (("Q", q, ["L", "d_k"]), ("K", k, ["S", "d_k"]), ("V", v, ["S", "d_v"]),
                          ("output", out, ["L", "d_v"]), ("weights", weights, ["L", "S"])):
        assert named(letters + last, t.shape) in text, name
    assert named(letters + ["d_k", "S"], k.transpose(-2, -1).shape) in text  # K^T
    assert f"$d_k$ = {d_k}" in text


def test_attention_flow_draws_the_mask_dashed_when_there_is_none():
    q = torch.randn(3, 2, generator=gen())
    mask_box = lambda fig: dg.drawing(fig).box("query may not attend")  # noqa: E731
    assert mask_box(dg.attention_flow_diagram(q, q, q)).patch.get_linestyle() != "-"
    assert "causal" in mask_box(dg.attention_flow_diagram(q, q, q, is_causal=True)).label
    boolean = dg.attention_flow_diagram(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool))
    assert mask_box(boolean).patch.get_linestyle() == "-" and "(3, 3)" in mask_box(boolean).label
    added = dg.drawing(dg.attention_flow_diagram(q, q, q, attn_mask=torch.zeros(1, 3)))
    assert "mask (1, 3): added to the scores" in added.labels


def test_attention_flow_steps_run_top_to_bottom_in_the_functions_order():
    q = torch.randn(3, 2, generator=gen())
    d = dg.drawing(dg.attention_flow_diagram(q, q, q))
    steps = ["QK^\\top", "divide by", "query may not attend", "softmax", "weights times values",
             "output"]
    heights = [d.box(step).y for step in steps]
    assert heights == sorted(heights, reverse=True)


# --- chapter 6: multi-head attention --------------------------------------------------------------

@pytest.mark.parametrize("D, H, G, B, T", [(8, 2, None, 2, 5), (12, 3, None, 1, 4),
                                           (16, 4, 2, 3, 6), (768, 12, 1, 1, 2)])
def test_multihead_labels_the_shapes_the_module_computes(D, H, G, B, T):
    mha = MultiHeadAttention(D, H, num_kv_heads=G)
    x = torch.randn(B, T, D, generator=gen(D))
    with torch.no_grad():
        out, weights = mha(x, x, x)
        q = mha.split_heads(mha.q_proj(x))
        k = mha.split_heads(mha.k_proj(x))
    d_h, G = mha.head_dim, mha.num_kv_heads
    fig = dg.multihead_diagram(mha, x)
    text = labels(fig)
    assert named(["B", "T", "d_model"], x.shape) in text
    assert named(["B", "T", "H", "d_h"], (B, T, H, d_h)) in text  # the view
    assert named(["B", "H", "T", "d_h"], q.shape) in text  # the transpose
    assert named(["B", "H", "T", "T"], weights.shape) in text
    assert named(["B", "T", "H·d_h"], out.shape) in text  # merged
    assert "output: " + named(["B", "T", "d_model"], out.shape) in text
    assert f"d_h = d_model / H = {D} / {H} = {d_h}" in text
    if G != H:
        assert named(["B", "G", "T", "d_h"], k.shape) in text
        assert f"G = {G} key-value heads" in text
    heads = [b for b in dg.drawing(fig).boxes if b.label.startswith("head ")]
    assert len(heads) == min(H, 4 if H > 8 else H)  # at most eight drawn, else 1, 2, 3, ..., H
    assert heads[-1].label.startswith(f"head {H}")


def test_multihead_leaves_the_module_as_it_was():
    mha = MultiHeadAttention(8, 2)
    before = {name: p.clone() for name, p in mha.named_parameters()}
    x = torch.randn(1, 3, 8, requires_grad=True)
    dg.multihead_diagram(mha, x)
    for name, p in mha.named_parameters():  # unchanged: still what was copied before
        numerics.assert_same(p, before[name])
        assert p.grad is None


# --- chapter 7: cross-attention and the encoder-decoder stack -------------------------------------

@pytest.mark.parametrize("L, S, d_dec, d_enc, d_k, d_v", [(3, 5, 4, 6, 2, 7), (6, 2, 3, 3, 5, 1)])
def test_cross_attention_draws_a_cell_per_entry_and_labels_the_shapes(L, S, d_dec, d_enc, d_k, d_v):
    g = gen(L)
    x_dec, x_enc = torch.randn(L, d_dec, generator=g), torch.randn(S, d_enc, generator=g)
    q, k, v = (torch.randn(n, w, generator=g) for n, w in ((L, d_k), (S, d_k), (S, d_v)))
    fig = dg.cross_attention_diagram(x_dec, x_enc, q, k, v)
    text = labels(fig)
    for letters, sizes in ((["L", "d_dec"], (L, d_dec)), (["S", "d_enc"], (S, d_enc)),
                           (["L", "d_k"], (L, d_k)), (["d_k", "S"], (d_k, S)),
                           (["S", "d_v"], (S, d_v)), (["L", "S"], (L, S)),
                           (["L", "d_v"], (L, d_v))):
        assert named(letters, sizes) in text
    entries = L * d_dec + S * d_enc + L * d_k + d_k * S + S * d_v + L * S + L * d_v
    assert len(dg.drawing(fig).cells) == entries


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("n_enc, n_dec", [(6, 6), (2, 3)])
def test_encoder_decoder_reads_the_stack_from_the_model(norm_first, n_enc, n_dec):
    model = transformer(d_model=48, nhead=6, n_enc=n_enc, n_dec=n_dec, d_ff=96,
                        norm_first=norm_first)
    fig = dg.encoder_decoder_diagram(model)
    d = dg.drawing(fig)
    text = labels(fig)
    assert f"encoder block × {n_enc}" in text and f"decoder block × {n_dec}" in text
    assert "MLP: Linear 48 → 96,\nReLU, Linear 96 → 48" in text and "H = 6 heads" in text
    assert ("pre-LN" if norm_first else "post-LN") in text and "(48 → n_vocab)" in text
    attention = sorted((b for b in d.boxes if b.kind == "attention"), key=lambda b: (b.x, b.y))
    assert [b.label.split("\n")[0] for b in attention] == [
        "self-attention", "masked self-attention", "cross-attention"]
    encoder, masked, cross = attention
    assert masked.y < cross.y and masked.x == cross.x > encoder.x  # the decoder, on the right
    assert "K, V" in text  # the encoder's output reaches the cross-attention
    norms = [b for b in d.boxes if b.kind == "norm"]
    # pre-LN: a norm on every branch (2 + 3) and the two final norms; post-LN: one on the
    # stream after every addition, and the final norms of nn.Transformer.
    assert len(norms) == 2 + 3 + 2
    on_stream = [b for b in norms if b.x in (encoder.x, cross.x)]
    assert bool(on_stream) == norm_first  # pre-LN norms share the branches' x
    assert "(48 → 1000)" in labels(dg.encoder_decoder_diagram(model, n_vocab=1000))


# --- chapter 9: the key-value cache ---------------------------------------------------------------

@pytest.mark.parametrize("D, H, G, T, B",
                         [(32, 4, None, 6, 1), (16, 4, 2, 3, 2), (24, 3, 1, 14, 1)])
def test_kv_cache_labels_the_cache_before_and_after_the_step(D, H, G, T, B):
    mha = MultiHeadAttention(D, H, num_kv_heads=G)
    cache, x_new = cached(mha, T, B=B)
    keys, seen = cache.keys.clone(), cache.seen
    fig = dg.kv_cache_diagram(mha, cache, x_new)
    numerics.assert_same(cache.keys, keys)  # the cache is left as it was: its copy before
    assert cache.seen == seen
    with torch.no_grad():
        out, weights = mha(x_new, x_new, x_new, is_causal=True, cache=cache)  # the real step
    text = labels(fig)
    kv = "H" if G is None else "G"
    assert named(["B", kv, "T", "d_h"], keys.shape) in text
    assert named(["B", kv, "T+1", "d_h"], cache.keys.shape) in text
    assert cache.keys.shape[-2] == T + 1
    assert named(["B", "H", "1", "T+1"], weights.shape) in text
    assert named(["B", "1", "d_model"], out.shape) in text
    assert f"at position {T}" in text and f"all T+1 = {T + 1} keys" in text
    assert "no mask" in text


def test_kv_cache_with_a_window_draws_the_ring_after_the_new_token_is_written():
    mha = MultiHeadAttention(16, 2)
    cache, x_new = cached(mha, 9, window=4)
    fig = dg.kv_cache_diagram(mha, cache, x_new)
    text = labels(fig)
    # position 9 overwrites slot 9 % 4 = 1 (position 5), then attends to the four slots
    assert "keeps W = 4 slots: (1, 2, 4, 8)" in text and "slot 1" in text
    assert "the ring's 4 slots, positions 6 to 9" in text and "no mask" in text
    drawn = [t.get_text() for t in dg.drawing(fig).cell_texts if t.get_text().isdigit()]
    assert drawn == ["6", "7", "8", "9"] * 2  # K and V, in position order
    grey = [t.get_text() for t, c in zip(dg.drawing(fig).cell_texts, dg.drawing(fig).cells)
            if c.get_facecolor()[:3] == to_rgb(dg.FILLS["skipped"])]
    assert grey == []  # the ring never gives the query a key outside its window


# --- chapter 10: FlashAttention's tiles -----------------------------------------------------------

@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("L, S, block_size", [(224, 224, None), (100, 60, 25), (64, 200, 50)])
def test_flash_tiles_number_the_tiles_in_the_loops_order(L, S, block_size, is_causal):
    g = gen(L)
    q, k, v = (torch.randn(n, w, generator=g) for n, w in ((L, 8), (S, 8), (S, 4)))
    fig = dg.flash_tiles_diagram(q, k, v, block_size=block_size, is_causal=is_causal)
    b = block_size or inspect.signature(flash_attention).parameters["block_size"].default
    order = visited_tiles(L, S, b, is_causal)
    d = dg.drawing(fig)
    numbers = [int(t.get_text()) for t in d.cell_texts]
    assert sorted(numbers) == list(range(1, len(order) + 1))
    # each number sits in the tile visited at that step: tile (I, J) spans rows I*b.. and cols J*b..
    x0, y0 = min(c.get_x() for c in d.cells), max(c.get_y() + c.get_height() for c in d.cells)
    unit = d.cells[0].get_width() / min(b, S)
    for text in d.cell_texts:
        x, y = text.get_position()
        tile = (int((y0 - y) / unit) // b, int((x - x0) / unit) // b)
        assert order[int(text.get_text()) - 1] == tile
    assert len(d.cells) == math.ceil(L / b) * math.ceil(S / b)  # skipped tiles drawn, unnumbered
    text = labels(fig)
    assert f"in {math.ceil(L / b)} blocks of r = {b}" in text and f"S = {S}" in text
    assert f"queries Q (r, d_k) = ({b}, 8)" in text
    assert f"accumulator ỹ (r, d_v) = ({b}, 4)" in text
    assert ("Hatched: skipped" in text) == is_causal


# --- the Transformer block and a decoder-only model -----------------------------------------------

def order_up(d, stream_x):
    """The boxes of a block from bottom to top: (kind, on the stream?)."""
    return [(b.kind, math.isclose(b.x, stream_x)) for b in sorted(d.boxes, key=lambda b: b.y)
            if b.kind in ("norm", "attention", "mlp", "add")]


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
@pytest.mark.parametrize("d_model, heads, d_ff", [(64, 4, 256), (4096, 32, 11008), (6, 3, 5)])
def test_block_diagram_draws_both_orders_in_their_order(d_model, heads, d_ff, activation):
    # On the meta device: the diagram reads sizes, not weights (202 M of them at Llama 2 7B's).
    pre = TransformerBlock(d_model, heads, d_ff, activation=activation, device="meta")
    post = TransformerBlock(d_model, heads, d_ff, activation=activation, norm_first=False,
                            device="meta")
    d_pre, d_post = dg.drawing(dg.block_diagram(pre)), dg.drawing(dg.block_diagram(post))
    stream = next(b.x for b in d_pre.boxes if b.kind == "add")  # the additions sit on it
    # pre-LN: x + Attn(LN1(x)), then x + MLP(LN2(x)); the norms on the branches.
    assert order_up(d_pre, stream) == [("norm", False), ("attention", False), ("add", True),
                                       ("norm", False), ("mlp", False), ("add", True)]
    # post-LN: LN1(x + Attn(x)), then LN2(x + MLP(x)); the norms on the stream.
    assert order_up(d_post, stream) == [("attention", False), ("add", True), ("norm", True),
                                        ("mlp", False), ("add", True), ("norm", True)]
    assert [b.label for b in d_pre.boxes if b.kind == "norm"] == ["LayerNorm LN1", "LayerNorm LN2"]
    for block, d in ((pre, d_pre), (post, d_post)):
        text = "\n".join(d.labels)
        assert f"d_model = {d_model}" in text
        assert f"H = {heads} heads of d_h = {d_model // heads}" in text
        hidden = 2 * d_ff if activation == "swiglu" else d_ff
        assert block.linear1.out_features == hidden
        assert f"({d_model} → {hidden})" in text and f"({d_ff} → {d_model})" in text
        assert {"relu": "ReLU", "gelu": "GELU", "swiglu": "SwiGLU"}[activation] in text
    assert "x + Attn(LN1(x)); x + MLP(LN2(x))" in d_pre.labels[-1]
    assert "LN1(x + Attn(x)); LN2(x + MLP(x))" in d_post.labels[-1]


def test_block_diagram_says_causal_when_told():
    block = TransformerBlock(8, 2, 16)
    assert "causal multi-head" in labels(dg.block_diagram(block, causal=True))
    assert "causal" not in labels(dg.block_diagram(block))


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-LN", "post-LN"])
@pytest.mark.parametrize("n_layers, n_vocab", [(1, 50), (12, 50257)])
def test_decoder_only_reads_the_blocks(norm_first, n_layers, n_vocab):
    blocks = nn.ModuleList(TransformerBlock(24, 3, 40, norm_first=norm_first)
                           for _ in range(n_layers))
    fig = dg.decoder_only_diagram(blocks, n_vocab)
    d = dg.drawing(fig)
    text = labels(fig)
    assert f"block × {n_layers}" in text and f"(24 → {n_vocab})" in text
    assert f"n_vocab × d_model = {n_vocab} × 24" in text and "causal multi-head" in text
    assert ("final LayerNorm" in text) == norm_first  # a final norm only after pre-LN blocks
    assert "tied" in text and f"(B, T, {n_vocab})" in text
    top = [b.label.split("\n")[0] for b in sorted(d.boxes, key=lambda b: b.y)][-2:]
    assert top == [f"Linear d_model → n_vocab (24 → {n_vocab})", "softmax over the vocabulary"]
    assert "tied" not in labels(dg.decoder_only_diagram(blocks, n_vocab, tied=False))


# --- an induction circuit -------------------------------------------------------------------------

def circuit(T, query, key, seed=0):
    """Random tokens, a previous-token head's weights (each position on the one before it) and
    an induction head's (uniform, but for ``query``, which puts 0.8 on ``key``)."""
    tokens = torch.randint(32, (T,), generator=gen(seed))
    previous = torch.zeros(T, T)
    previous[0, 0] = 1.0
    previous[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    induction = torch.ones(T, T).tril()
    induction = induction / induction.sum(1, keepdim=True)
    induction[query] = torch.where(torch.arange(T) <= query, 0.2 / query, 0.0)
    induction[query, key] = 0.8
    return tokens, previous, induction


@pytest.mark.parametrize("T, query, key", [(12, 9, 4), (24, 23, 1), (6, 3, 2), (24, 12, 11)])
def test_induction_circuit_reads_the_heads_strongest_keys(T, query, key):
    tokens, previous, induction = circuit(T, query, key, seed=T)
    names = ["BOS"] + [f"t{int(t)}" for t in tokens[1:]]
    fig = dg.induction_circuit_diagram(tokens, previous, induction, query, labels=names,
                                       prediction=names[key])
    d = dg.drawing(fig)
    text = labels(fig)
    assert [t.get_text() for t in d.cell_texts] == [x for p in range(query + 1)
                                                     for x in (names[p], str(p))]
    assert (f"position {query}, token {names[query]}, reads position {key} (weight 0.80)"
            in text.replace("\n", " "))
    arcs = [(a._posA_posB[0][0], a._posA_posB[1][0]) for a in d.lines
            if isinstance(a, FancyArrowPatch)
            and getattr(a.get_connectionstyle(), "rad", 0.0) != 0.0]  # arcs, not arrows
    centre = lambda p: (p + 0.5) * 0.5  # noqa: E731  (cells of 0.5 units)
    expected = [(centre(key), centre(query))] + ([(centre(key - 1), centre(key))] if key else [])
    assert sorted(arcs) == sorted(expected)  # from the key read to the query reading it
    assert (f"position {key} reads position {key - 1} (weight 1.00)" in text) == (key > 0)
    assert f"at {query}: {names[key]}" in text
    assert not layout_problems(fig)


# --- into a given Axes ----------------------------------------------------------------------------

def test_every_diagram_draws_into_a_given_axes():
    for name, fig in draw_all(lambda: plt.subplots(1, 2, figsize=(12, 8))[1][1]):
        assert len(fig.axes) == 2, name  # the caller's figure, with both of its axes
        d = dg.drawing(fig.axes[1])
        assert d.ax is fig.axes[1] and d.labels, name
        with pytest.raises(ValueError):
            dg.drawing(fig.axes[0])  # nothing drawn there


def test_two_blocks_side_by_side_at_full_size():
    fig, axes = plt.subplots(1, 2, figsize=(2 * dg.BLOCK_FIGSIZE[0], dg.BLOCK_FIGSIZE[1]),
                             gridspec_kw=dict(left=0, right=1, bottom=0, top=1, wspace=0))
    for ax, norm_first in zip(axes, (True, False)):
        assert dg.block_diagram(TransformerBlock(64, 4, 256, norm_first=norm_first), ax=ax) is fig
    assert [dg.drawing(ax).scale for ax in axes] == [1.0, 1.0]
    assert axes[0].get_ylim() == axes[1].get_ylim()  # one canvas for both orders: they line up
    assert not layout_problems(fig)
    with pytest.raises(ValueError, match="2 diagrams"):
        dg.drawing(fig)


def test_a_small_axes_shrinks_the_text_with_the_drawing():
    fig, ax = plt.subplots(figsize=(2.5, 3))
    dg.block_diagram(TransformerBlock(64, 4, 256), ax=ax)
    d = dg.drawing(ax)
    assert 0.3 < d.scale < 1.0
    assert all(t.get_fontsize() < dg.SMALL for t in d.texts)
    assert not layout_problems(fig)


# --- bad input ------------------------------------------------------------------------------------

def test_bad_input_is_refused_with_the_reason():
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    cache, x_new = cached(mha, 3)
    block = TransformerBlock(8, 2, 16)
    q = torch.randn(3, 4)
    cases = [
        (lambda: dg.block_diagram(nn.Linear(2, 2)), TypeError, "draws a TransformerBlock"),
        (lambda: dg.block_diagram(block, ax="left"), TypeError, "ax must be a matplotlib Axes"),
        (lambda: dg.multihead_diagram(nn.MultiheadAttention(8, 2), x), TypeError,
         "MultiHeadAttention of code/attention.py"),
        (lambda: dg.multihead_diagram(mha, torch.randn(1, 3, 6)), ValueError, "d_model=8"),
        (lambda: dg.attention_flow_diagram(q, torch.randn(3, 5), q), ValueError, "same last dim"),
        (lambda: dg.attention_flow_diagram(q, q, q, attn_mask=torch.ones(2, 2, dtype=torch.bool)),
         ValueError, "does not broadcast"),
        (lambda: dg.cross_attention_diagram(q, q, torch.randn(2, 4), q, q), ValueError,
         "q needs x_dec's 3 rows"),
        (lambda: dg.cross_attention_diagram(q[None], q, q, q, q), ValueError, "2-D"),
        (lambda: dg.encoder_decoder_diagram(block), TypeError, "torch.nn.Transformer"),
        (lambda: dg.encoder_decoder_diagram(transformer(), n_vocab=0), ValueError, "n_vocab"),
        (lambda: dg.kv_cache_diagram(mha, KVCache(), x_new), ValueError, "the cache is empty"),
        (lambda: dg.kv_cache_diagram(mha, cache, torch.randn(1, 2, 8)), ValueError,
         "one new position"),
        (lambda: dg.kv_cache_diagram(mha, {}, x_new), TypeError, "KVCache"),
        (lambda: dg.flash_tiles_diagram(q, q, q, block_size=0), ValueError, "block_size"),
        (lambda: dg.flash_tiles_diagram(*(torch.randn(1000, 4),) * 3, block_size=8), ValueError,
         "at most|1 to 12"),
        (lambda: dg.decoder_only_diagram(block, 10), TypeError, "sequence of TransformerBlocks"),
        (lambda: dg.decoder_only_diagram([], 10), ValueError, "at least one block"),
        (lambda: dg.decoder_only_diagram([block, TransformerBlock(8, 2, 16, norm_first=False)],
                                         10), ValueError, "must agree"),
        (lambda: dg.decoder_only_diagram([block, nn.Linear(2, 2)], 10), TypeError, "block 1"),
        (lambda: dg.decoder_only_diagram([block], 0), ValueError, "n_vocab"),
        (lambda: dg.drawing(plt.figure()), ValueError, "0 diagrams"),
        (lambda: dg.induction_circuit_diagram(torch.zeros(4, 2, dtype=torch.long),
                                              torch.eye(4), torch.eye(4), 2), ValueError,
         "1-D integer tensor"),
        (lambda: dg.induction_circuit_diagram(torch.arange(4), torch.eye(5), torch.eye(4), 2),
         ValueError, r"previous must be the \(T, T\) = \(4, 4\) weights .* shape \(5, 5\)"),
        (lambda: dg.induction_circuit_diagram(torch.arange(4), torch.eye(4), torch.eye(4), 4),
         ValueError, "query must be a position in 2..3"),
        (lambda: dg.induction_circuit_diagram(torch.arange(4), torch.eye(4), torch.eye(4), 2,
                                              labels=["a"]), ValueError, "name the 4 tokens"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


# --- the layout, looked at by a program -----------------------------------------------------------

def luminance(colour) -> float:
    """WCAG relative luminance."""
    channel = lambda c: c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4  # noqa: E731
    r, g, b = (channel(c) for c in to_rgb(colour))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_text_is_dark_on_light_fills_on_white():
    """The site shows figures on a white panel in both themes: every fill must keep the
    labels' contrast at the WCAG's AAA level (7:1), and text and figures are not transparent."""
    ink = luminance(dg.INK)
    for kind, fill in dg.FILLS.items():
        assert (luminance(fill) + 0.05) / (ink + 0.05) >= 7, kind
    for name, fig in draw_all():
        assert to_rgb(fig.get_facecolor()) == (1, 1, 1), name
        assert {t.get_color() for t in dg.drawing(fig).texts} == {dg.INK}, name


def test_the_diagrams_own_figures_fit_the_books_column():
    for name, fig in draw_all():
        width, height = fig.get_size_inches()
        assert width <= 8.2 and height <= 9.5, (name, width, height)
        assert dg.drawing(fig).scale == 1.0


@pytest.mark.parametrize("name", ["flow", "multihead", "cross", "stack", "kv cache", "flash",
                                  "block", "decoder-only", "induction"])
def test_layout_text_in_its_box_nothing_overlaps_or_is_cut_off(name):
    fig = dict(draw_all())[name]
    assert not layout_problems(fig)


@pytest.mark.parametrize("case", range(6))
def test_layout_holds_for_other_sizes(case):
    g = gen(case)
    gqa = MultiHeadAttention(64, 8, num_kv_heads=2)
    fig = [
        lambda: dg.attention_flow_diagram(torch.randn(2, 3, 9, 64, generator=g),
                                          torch.randn(2, 3, 12, 64, generator=g),
                                          torch.randn(2, 3, 12, 128, generator=g), is_causal=True),
        lambda: dg.multihead_diagram(MultiHeadAttention(4096, 32, num_kv_heads=8),
                                     torch.randn(1, 2, 4096, generator=g)),
        lambda: dg.cross_attention_diagram(*(torch.randn(n, w, generator=g) for n, w in
                                             ((12, 12), (1, 12), (12, 1), (1, 1), (1, 12)))),
        lambda: dg.kv_cache_diagram(gqa, *cached(gqa, 40, window=6, B=4)),
        lambda: dg.flash_tiles_diagram(*(torch.randn(1024, 64, generator=g) for _ in range(3)),
                                       block_size=128, is_causal=True),
        lambda: dg.decoder_only_diagram([TransformerBlock(4096, 32, 11008, activation="swiglu",
                                                          device="meta")] * 32, 128256),
    ][case]()
    assert not layout_problems(fig)


def layout_problems(fig, tol: float = 1.0) -> list[str]:
    """What a reader would see wrong in the diagrams of ``fig``, as rendered: a label outside
    its box or cell, two labels overlapping, a label on a box, a cell or a frame's outline, a
    line or arrow through a label, an arrow that ends on nothing, anything cut off."""
    fig.canvas.draw()
    problems = []
    edge = fig.bbox

    def extent(artist):
        return artist.get_window_extent()

    def inside(e, g, slack=tol):
        return (e.x0 >= g.x0 - slack and e.x1 <= g.x1 + slack and e.y0 >= g.y0 - slack
                and e.y1 <= g.y1 + slack)

    def overlap(e, g):
        both = Bbox.intersection(e, g)
        return both is not None and both.width > tol and both.height > tol

    for ax in fig.axes:
        if not hasattr(ax, "_diagram"):
            continue
        d = dg.drawing(ax)
        texts = [(t, extent(t)) for t in d.texts if t.get_text().strip()]
        own = {id(b.text) for b in d.boxes} | {id(t) for t in d.cell_texts}
        problems += [f"cut off: {t.get_text()!r}" for t, e in texts if not inside(e, edge)]
        problems += [f"cut off: {b.label!r}" for b in d.boxes if not inside(extent(b.patch), edge)]
        problems += [f"outside its box: {b.label!r}" for b in d.boxes
                     if b.label.strip() and not inside(extent(b.text), extent(b.patch))]
        problems += [f"outside its cell: {t.get_text()!r}" for t in d.cell_texts
                     if t.get_text() != "..." and not any(inside(extent(t), extent(c))
                                                          for c in d.cells)]
        problems += [f"overlapping labels: {t.get_text()!r}, {u.get_text()!r}"
                     for i, (t, e) in enumerate(texts) for u, f in texts[i + 1:] if overlap(e, f)]
        boxes = [(b.label, extent(b.patch)) for b in d.boxes]
        problems += [f"overlapping boxes: {a!r}, {b!r}" for i, (a, e) in enumerate(boxes)
                     for b, f in boxes[i + 1:] if overlap(e, f)]
        obstacles = boxes + [("a cell", extent(c)) for c in d.cells]
        for t, e in texts:
            if id(t) not in own:
                problems += [f"{t.get_text()!r} on {name!r}" for name, g in obstacles
                             if overlap(e, g)]
            problems += [f"{t.get_text()!r} across a frame" for f in d.frames
                         if overlap(e, extent(f)) and not inside(e, extent(f))]
        targets = [extent(a) for a in [*(b.patch for b in d.boxes), *d.cells, *d.frames]]
        for line in d.lines:
            if isinstance(line, FancyArrowPatch):  # an arrow: its head must touch something
                path = ax.transData.transform_path(line.get_path())
                end = ax.transData.transform(line._posA_posB[1])
                if not any(inside(Bbox([end, end]), g, 3) for g in targets):
                    problems.append(f"an arrow ends on nothing at {line._posA_posB[1]}")
            else:
                path = line.get_transform().transform_path(line.get_path())
            segments = [(a, b) for poly in path.to_polygons(closed_only=False)
                        for a, b in zip(poly, poly[1:])]
            for t, e in texts:
                shrunk = Bbox.from_extents(e.x0 + tol, e.y0 + tol, e.x1 - tol, e.y1 - tol)
                if any(crosses(a, b, shrunk) for a, b in segments):
                    problems.append(f"a line crosses {t.get_text()!r}")
    return problems


def crosses(a, b, box) -> bool:
    """Whether the segment from a to b meets the rectangle ``box`` (Liang-Barsky clipping)."""
    (x0, y0), (x1, y1) = a, b
    dx, dy = x1 - x0, y1 - y0
    lo, hi = 0.0, 1.0
    for p, q in ((-dx, x0 - box.x0), (dx, box.x1 - x0), (-dy, y0 - box.y0), (dy, box.y1 - y0)):
        if p == 0:
            if q < 0:
                return False
            continue
        t = q / p
        lo, hi = (max(lo, t), hi) if p < 0 else (lo, min(hi, t))
        if lo > hi:
            return False
    return True

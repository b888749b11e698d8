"""code/io_model.py: attention on a simulated two-level memory computes attention and its
gradients, never holds more than the fast memory, and moves exactly what the formulas say."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import numerics
from attention import scaled_dot_product_attention
from flash import flash_decode
from io_model import (TwoLevelMemory, decode_blocks, flash_backward, flash_backward_counts,
                      flash_blocks, flash_decode_counts, flash_decode_forward, flash_forward,
                      flash_forward_counts, standard_blocks, standard_counts, standard_forward)

F64 = torch.float64
SHAPES = [(37, 53, 8, 6), (64, 64, 16, 16), (100, 30, 4, 12), (1, 9, 5, 3), (9, 1, 3, 5)]


def inputs(L, S, E, Ev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"Q": torch.randn(L, E, generator=gen, dtype=F64),
            "K": torch.randn(S, E, generator=gen, dtype=F64),
            "V": torch.randn(S, Ev, generator=gen, dtype=F64)}


def reference(t, is_causal=False):
    return scaled_dot_product_attention(t["Q"], t["K"], t["V"], is_causal=is_causal)[0]


@pytest.mark.parametrize("L,S,E,Ev", SHAPES)
@pytest.mark.parametrize("M", [400, 2000, 10_000])
def test_both_forward_passes_compute_attention_and_move_what_the_formulas_say(L, S, E, Ev, M):
    t = inputs(L, S, E, Ev)
    r, c = flash_blocks(M, E, Ev)
    tiled = TwoLevelMemory(M, **t)
    flash_forward(tiled, r, c)
    torch.testing.assert_close(tiled.slow["Y"], reference(t))
    torch.testing.assert_close(tiled.slow["lse"], torch.logsumexp(t["Q"] @ t["K"].T / E**0.5, -1))
    counts = flash_forward_counts(L, S, E, Ev, r)
    assert (tiled.reads, tiled.writes, tiled.accesses) == (
        counts["reads"], counts["writes"], counts["accesses"])
    assert tiled.peak <= M and tiled.held == 0
    if S <= M:
        standard = TwoLevelMemory(M, **t)
        standard_forward(standard, r, c)
        torch.testing.assert_close(standard.slow["Y"], reference(t))
        counts = standard_counts(L, S, E, Ev, r, M)
        assert (standard.reads, standard.writes) == (counts["reads"], counts["writes"])
        assert standard.peak <= M and standard.held == 0
        assert standard.accesses - tiled.accesses == 4 * L * S - L


@pytest.mark.parametrize("L,S", [(37, 53), (53, 37), (64, 64)])
def test_the_causal_forward_reads_keys_only_for_the_tiles_it_visits(L, S):
    t = inputs(L, S, 8, 8, seed=1)
    r, c = 7, 5
    mem = TwoLevelMemory(5000, **t)
    flash_forward(mem, r, c, is_causal=True)
    torch.testing.assert_close(mem.slow["Y"], reference(t, is_causal=True))
    visited_keys = sum(min(j0 + c, S) - j0 for i0 in range(0, L, r)
                       for j0 in range(0, S, c) if j0 <= min(i0 + r, L) - 1)
    assert mem.reads == L * 8 + visited_keys * 16
    assert mem.writes == L * 8 + L


@pytest.mark.parametrize("order", ["queries", "keys"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("L,S,E,Ev", [(37, 53, 8, 6), (53, 37, 4, 4), (16, 16, 8, 8)])
def test_both_backward_orders_give_autograds_gradients(order, is_causal, L, S, E, Ev):
    t = inputs(L, S, E, Ev, seed=2)
    d_y = torch.randn(L, Ev, generator=torch.Generator().manual_seed(3), dtype=F64)
    leaves = {n: x.clone().requires_grad_() for n, x in t.items()}
    scaled_dot_product_attention(leaves["Q"], leaves["K"], leaves["V"],
                                 is_causal=is_causal)[0].backward(d_y)
    forward = TwoLevelMemory(10_000, **t)
    flash_forward(forward, 6, 5, is_causal=is_causal)
    mem = TwoLevelMemory(10_000, **t, Y=forward.slow["Y"], lse=forward.slow["lse"], dY=d_y)
    flash_backward(mem, 6, 5, order=order, is_causal=is_causal)
    for name in ("Q", "K", "V"):
        torch.testing.assert_close(mem.slow["d" + name], leaves[name].grad)
    assert mem.held == 0
    if not is_causal:
        counts = flash_backward_counts(L, S, E, Ev, 6, 5, order)
        assert (mem.reads, mem.writes) == (counts["reads"], counts["writes"])


def test_the_keys_outside_backward_moves_fewer_numbers_for_square_tiles():
    for n, d, b in [(256, 32, 16), (1024, 64, 64), (4096, 128, 64)]:
        q, k = (flash_backward_counts(n, n, d, d, b, b, o) for o in ("queries", "keys"))
        assert k["accesses"] < q["accesses"] and k["writes"] < q["writes"]


def test_the_fast_memory_is_never_exceeded_and_says_so():
    mem = TwoLevelMemory(100, Q=torch.zeros(20, 8))
    a = mem.read("Q", slice(0, 10))  # 80 numbers
    with pytest.raises(MemoryError, match=r"M=100.*80 held.*80 more.*\(10, 8\)"):
        mem.read("Q", slice(10, 20))
    mem.free(a)
    assert mem.held == 0 and mem.peak == 80 and mem.reads == 80
    with pytest.raises(ValueError, match="not in fast memory"):
        mem.write("Q", slice(0, 10), torch.zeros(10, 8))


def test_standard_attention_reads_rows_longer_than_the_fast_memory_twice():
    t = inputs(5, 300, 2, 3, seed=4)
    M = 256
    r, c = standard_blocks(M, 2, 3)
    mem = TwoLevelMemory(M, **t)
    standard_forward(mem, r, c)
    torch.testing.assert_close(mem.slow["Y"], reference(t))
    counts = standard_counts(5, 300, 2, 3, r, M)
    assert (mem.reads, mem.writes) == (counts["reads"], counts["writes"])
    assert counts["reads"] - standard_counts(5, 300, 2, 3, r)["reads"] == 5 * 300
    assert mem.peak <= M


def test_plain_attention_moves_fewer_numbers_when_the_fast_memory_is_small_against_d_squared():
    """With each pass's own blocks, tiling loses below about d^2 and wins above it."""
    N, d = 4096, 64
    for M, tiled_wins in [(2**10, False), (2**11, False), (2**13, True), (2**14, True)]:
        standard = standard_counts(N, N, d, d, standard_blocks(M, d)[0], M)["accesses"]
        tiled = flash_forward_counts(N, N, d, d, flash_blocks(M, d)[0])["accesses"]
        assert (tiled < standard) == tiled_wins, (M, standard, tiled)


@pytest.mark.parametrize("L,S,E,Ev", SHAPES)
@pytest.mark.parametrize("M", [300, 5000])
def test_standard_blocks_fit(L, S, E, Ev, M):
    t = inputs(L, S, E, Ev)
    r, c = standard_blocks(M, E, Ev)
    mem = TwoLevelMemory(M, **t)
    standard_forward(mem, r, c)
    torch.testing.assert_close(mem.slow["Y"], reference(t))
    assert mem.peak <= M
    counts = standard_counts(L, S, E, Ev, r, M)
    assert (mem.reads, mem.writes) == (counts["reads"], counts["writes"])


@pytest.mark.parametrize("M", [0, -3, 2.5, True, "64"])
def test_a_bad_memory_size_is_refused(M):
    with pytest.raises(ValueError, match="positive whole number"):
        TwoLevelMemory(M)


def test_blocks_fit_and_grow_with_the_fast_memory():
    for d in (8, 32, 64, 128):
        rows = []
        for M in [4 * d + 6] + [2**k for k in range(8, 20) if 2**k >= 4 * d + 6]:
            r, c = flash_blocks(M, d)
            assert 1 <= c <= d and r >= 1
            assert r * (2 * d + 5 + c) + c * 2 * d <= M  # what flash_forward holds at most
            rows.append(r)
        assert rows == sorted(rows)
    with pytest.raises(ValueError, match="cannot hold one query row"):
        flash_blocks(4 * 64 + 5, 64)


def test_a_bad_order_is_refused():
    with pytest.raises(ValueError, match="order must be"):
        flash_backward_counts(8, 8, 4, 4, 2, 2, order="rows")


# --- decoding: flash_decode_forward ------------------------------------------------------------

DECODE_SHAPES = [(8, 2, 1, 100, 16, 16), (8, 2, 3, 37, 16, 8), (4, 4, 1, 9, 5, 5),
                 (6, 1, 2, 50, 8, 8), (16, 8, 1, 64, 8, 12), (2, 1, 4, 4, 4, 4)]


def decode_inputs(H, G, L, S, E, Ev, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    return {"Q": torch.randn(H, L, E, generator=gen, dtype=dtype),
            "K": torch.randn(G, S, E, generator=gen, dtype=dtype),
            "V": torch.randn(G, S, Ev, generator=gen, dtype=dtype)}


@pytest.mark.parametrize("H,G,L,S,E,Ev", DECODE_SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_flash_decode_forward_is_grouped_attention_and_moves_what_the_formula_says(
        H, G, L, S, E, Ev, num_splits, packed, dtype):
    t = decode_inputs(H, G, L, S, E, Ev, dtype=dtype)
    M = 3000
    mem = TwoLevelMemory(M, **t)
    flash_decode_forward(mem, decode_blocks(M, (H // G if packed else 1) * L, E, Ev),
                         num_splits=num_splits, packed=packed)
    sees = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)  # bottom right
    want = F.scaled_dot_product_attention(t["Q"][None], t["K"][None], t["V"][None],
                                          attn_mask=sees, enable_gqa=True)[0]
    numerics.assert_close(mem.slow["Y"], want, factor=4)  # S up to 100 keys summed
    if Ev == E:
        numerics.assert_close(mem.slow["Y"], flash_decode(
            t["Q"][None], t["K"][None], t["V"][None], num_splits=num_splits)[0], factor=4)
    counts = flash_decode_counts(H, G, L, S, E, Ev, num_splits=num_splits, packed=packed)
    assert (mem.reads, mem.writes, mem.accesses) == (
        counts["reads"], counts["writes"], counts["accesses"])
    assert mem.peak <= M and mem.held == 0


@pytest.mark.parametrize("H,G", [(16, 16), (16, 4), (16, 1), (6, 2)])
def test_packing_reads_each_shared_head_once_instead_of_once_per_query_head(H, G):
    S, E = 40, 8
    runs = {}
    for packed in (True, False):
        mem = TwoLevelMemory(5000, **decode_inputs(H, G, 1, S, E, E, seed=1))
        flash_decode_forward(mem, 7, num_splits=2, packed=packed)
        runs[packed] = mem
    numerics.assert_close(runs[True].slow["Y"], runs[False].slow["Y"])
    assert runs[False].reads - runs[True].reads == (H - G) * S * 2 * E
    assert runs[True].writes == runs[False].writes


def test_flash_decode_forward_with_a_scale_and_a_small_fast_memory():
    t = decode_inputs(4, 2, 1, 30, 4, 4, seed=2)
    mem = TwoLevelMemory(60, **t)  # 2 rows of a group: at least 2 * (4 + 4 + 6) + 8 = 36
    flash_decode_forward(mem, decode_blocks(60, 2, 4), num_splits=5, scale=0.3)
    want = F.scaled_dot_product_attention(t["Q"][None], t["K"][None], t["V"][None],
                                          enable_gqa=True, scale=0.3)[0]
    numerics.assert_close(mem.slow["Y"], want)
    assert mem.peak <= 60
    with pytest.raises(ValueError, match="cannot hold 2 query rows"):
        decode_blocks(35, 2, 4)


def test_flash_decode_forward_refuses_heads_that_do_not_group():
    mem = TwoLevelMemory(1000, **decode_inputs(6, 4, 1, 10, 4, 4))
    with pytest.raises(ValueError, match="G dividing H"):
        flash_decode_forward(mem, 2)

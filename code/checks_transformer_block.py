"""The checks of Chapter 11, The Transformer block (the machinery: checking.py)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from checking import Check, Rule, attention_rule, module_rules, tensor_like

# layer_norm(x, gain, shift, eps=1e-5) -> (..., D), normalised over the last axis


def _norm_rules() -> list[Rule]:
    """PyTorch's normalisations in any form: layer norm, and the group, batch and instance
    norms that compute it after a reshape (GroupNorm with one group is a layer norm), RMSNorm
    (its first step), PyTorch's Python references; and the book's block, whose norms are
    nn.LayerNorm."""
    def objects():
        from torch import nn
        return [nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase,
                F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm, F.rms_norm]
    return [Rule("a ready-made normalisation (F.layer_norm, nn.LayerNorm, F.group_norm, "
                 "F.batch_norm, F.instance_norm, F.rms_norm, ...)",
                 aten=("layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm"),
                 python=objects, elsewhere={"torch._refs": ("*",),
                                            "torch._decomp.decompositions": ("*",)}),
            attention_rule(), *module_rules("TransformerBlock", module="transformer")]


check_layer_norm = Check("check_layer_norm", rules=_norm_rules(), unchanged="one position")


def _reference(x, gain, shift, eps):
    """PyTorch's layer norm in float64."""
    return F.layer_norm(x.double(), x.shape[-1:], gain.double(), shift.double(), eps)


def _call(fn, where, x, gain, shift, eps=None):
    kwargs = {} if eps is None else {"eps": eps}
    try:
        with warnings.catch_warnings():  # torch.var's warning for D = 1: the case says it
            warnings.simplefilter("ignore")
            out = fn(x, gain, shift, **kwargs)
    except RuntimeError as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; x is (..., D) and gain and shift are (D,): "
            "reduce over the last axis with keepdim=True so that the mean and the variance "
            "broadcast") from None
    tensor_like(out, x.shape, where)
    return out


def _compare(fn, where, x, gain, shift, eps=1e-5, pass_eps=False, atol=1e-5):
    """The answer against PyTorch's layer norm; if they differ, the mistake it reproduces."""
    got = _call(fn, where, x, gain, shift, eps if pass_eps else None)
    want = _reference(x, gain, shift, eps)
    got64 = got.double()
    scale = 1 + float(want.abs().max())
    if torch.allclose(got64, want, rtol=0, atol=atol * scale):
        return
    x64, g, b = x.double(), gain.double(), shift.double()
    mean = x64.mean(-1, keepdim=True)
    D = x.shape[-1]

    def norm(centre, var, eps_inside=True):
        if eps_inside:
            return (x64 - centre) / torch.sqrt(var + eps) * g + b
        return (x64 - centre) / (torch.sqrt(var) + eps) * g + b

    biased = x64.var(-1, unbiased=False, keepdim=True)
    mistakes = [
        (lambda: (x64 - mean) / torch.sqrt(biased + eps),
         "gain and shift are not applied: multiply by gain and add shift after normalising"),
        (lambda: (x64 - mean) / torch.sqrt(biased + eps) * b + g,
         "gain and shift are swapped: y = gain * x_hat + shift"),
        (lambda: x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * g + b,
         "the mean is not subtracted (that is RMSNorm, not a layer norm)"),
        (lambda: (x64 - mean) / torch.sqrt(biased) * g + b,
         "eps is left out: the variance needs eps added inside the square root"),
        (lambda: norm(mean, biased, eps_inside=False),
         "eps is added to the standard deviation; PyTorch adds it to the variance, inside the "
         "square root: sqrt(var + eps)"),
        (lambda: (x64 - mean) / (biased + eps) * g + b,
         "divided by the variance; divide by the standard deviation, sqrt(var + eps)"),
    ]
    if D > 1:
        unbiased = x64.var(-1, unbiased=True, keepdim=True)
        mistakes.insert(0, (lambda: norm(mean, unbiased),
                            "the variance divides by D - 1 (torch.var's default, unbiased=True); "
                            "a layer norm divides by D: unbiased=False or correction=0"))
    if x.dim() > 1 and x.shape[0] > 1:
        m0, v0 = x64.mean(0, keepdim=True), x64.var(0, unbiased=False, keepdim=True)
        mistakes.append((lambda: (x64 - m0) / torch.sqrt(v0 + eps) * g + b,
                         "normalised over the first axis (the batch); a layer norm normalises "
                         "each position over its own D features, the last axis"))
        every = (x64 - x64.mean()) / torch.sqrt(x64.var(unbiased=False) + eps) * g + b
        mistakes.append((lambda: every, "normalised over every entry at once; a layer norm "
                         "normalises each position over its own D features, the last axis"))
    for wrong, message in mistakes:
        try:
            value = wrong()
        except RuntimeError:
            continue
        if torch.allclose(got64, value, rtol=0, atol=atol * scale, equal_nan=True) and not (
                torch.allclose(value, want, rtol=0, atol=atol * scale)):
            raise AssertionError(f"{where}: {message}")
    if not torch.isfinite(got).all():
        raise AssertionError(f"{where}: NaN or inf in the output")
    err = float((got64 - want).abs().max())
    raise AssertionError(f"{where}: differs from PyTorch's layer norm by up to {err:.3g}")


def _inputs(seed, shape, size=1.0, offset=0.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = (offset + size * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    gain = (0.5 + torch.rand(D, generator=g, dtype=torch.float64)).to(dtype)
    shift = torch.randn(D, generator=g, dtype=torch.float64).to(dtype)
    return x, gain, shift


@check_layer_norm.case("shapes")
def _(fn):
    for shape in ((5, 8), (2, 3, 8), (4, 6), (8,)):
        x, gain, shift = _inputs(1, shape)
        _call(fn, f"x of shape {shape}", x, gain, shift)


@check_layer_norm.case("one position")
def _(fn):
    _compare(fn, "x of shape (1, 8)", *_inputs(2, (1, 8)))


@check_layer_norm.case("a batch of sequences, gain and shift")
def _(fn):
    _compare(fn, "x of shape (3, 4, 8)", *_inputs(3, (3, 4, 8), size=2.0, offset=1.0))


@check_layer_norm.case("eps given")
def _(fn):
    x, gain, shift = _inputs(4, (2, 5, 6), size=0.05)  # a spread near sqrt(eps): eps matters
    where = "x of shape (2, 5, 6) and eps=0.01"
    got = _call(fn, where, x, gain, shift, eps=1e-2)
    if torch.allclose(got.double(), _reference(x, gain, shift, 1e-5), rtol=0, atol=1e-4):
        raise AssertionError(f"{where}: the eps argument is ignored (the result is that of "
                             "eps=1e-5): use eps, not a constant")
    _compare(fn, where, x, gain, shift, eps=1e-2, pass_eps=True)
    _compare(fn, "x of shape (2, 5, 6), the default eps", x, gain, shift)


@check_layer_norm.case("a large mean, a small spread")
def _(fn):
    x, gain, shift = _inputs(5, (4, 16), size=1.0, offset=3000.0)
    where = "x = 3000 + noise of size 1, float32"
    got = _call(fn, where, x, gain, shift)
    mean = x.mean(-1, keepdim=True)
    naive = (x - mean) / torch.sqrt(x.pow(2).mean(-1, keepdim=True) - mean ** 2 + 1e-5)
    naive = naive * gain + shift  # the variance as mean(x**2) - mean(x)**2, in float32
    want = _reference(x, gain, shift, 1e-5)
    if torch.allclose(got.double(), naive.double(), rtol=0, atol=1e-3, equal_nan=True) and not (
            torch.allclose(naive.double(), want, rtol=0, atol=1e-2)):
        raise AssertionError(
            f"{where}: the variance is computed as mean(x**2) - mean(x)**2, whose two terms "
            "are about 9e6 and cancel in float32 (7 digits): subtract the mean first, then "
            "average the squares")
    _compare(fn, where, x, gain, shift, atol=2e-3)


@check_layer_norm.case("one feature, D = 1")
def _(fn):
    x, gain, shift = _inputs(6, (3, 1))
    got = _call(fn, "x of shape (3, 1)", x, gain, shift)
    assert torch.isfinite(got).all(), (
        "x of shape (3, 1): NaN for D = 1; torch.var divides by D - 1 = 0 by default: a layer "
        "norm's variance divides by D (unbiased=False)")
    _compare(fn, "x of shape (3, 1)", x, gain, shift)


@check_layer_norm.case("sizes drawn at random")
def _(fn):
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        shape = tuple(int(n) for n in torch.randint(2, 7, (int(torch.randint(1, 4, (),
                                                                generator=g)),), generator=g))
        size = float(torch.rand((), generator=g)) * 5 + 0.1
        _compare(fn, f"x of shape {shape}", *_inputs(int(torch.randint(100, (), generator=g)),
                                                     shape, size=size, offset=size))


# pre_ln_block(x, block, *, attn_mask=None, is_causal=False) and post_ln_block(...) -> (B, T, D):
# the block's two orders written from its parts


def _block_rules() -> list[Rule]:
    """The whole block, however reached: the module's TransformerBlock (its forward, its
    _attention and _mlp), DecoderLM, and PyTorch's Transformer layers and their fused kernel."""
    def objects():
        from torch import nn
        return [nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
                nn.TransformerDecoder, nn.Transformer]
    return [Rule("PyTorch's Transformer layers (nn.TransformerEncoderLayer, nn.Transformer, ...)",
                 aten=("_transformer_encoder",), python=objects),
            *module_rules("TransformerBlock", "DecoderLM", module="transformer")]


def _warm_up() -> None:
    """The block's forward and backward once, masked and causal, before any recording: their
    first call imports and sets up what later calls reuse."""
    for norm_first in (True, False):
        block = _book_block(0, 8, 2, 16, norm_first).train()
        x = _x(0, 2, 3, 8)
        block(x, is_causal=True).sum().backward()
        with torch.no_grad():
            block.eval()(x, attn_mask=_padding(2, 3, [3, 2]))


check_block = Check("check_block", rules=_block_rules(),
                    unchanged=("pre-LN, a padding mask", "post-LN, a padding mask"),
                    prepare=lambda: _warm_up())


def _book_block(seed: int, d_model: int, num_heads: int, d_ff: int, norm_first: bool,
                activation: str = "gelu"):
    """A TransformerBlock with weights drawn from ``seed`` (biases and norms away from their
    initial 0 and 1, so that each is seen), in eval mode, float32."""
    from transformer import TransformerBlock
    torch.manual_seed(seed)
    block = TransformerBlock(d_model, num_heads, d_ff, norm_first=norm_first,
                             activation=activation)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return block.eval()


def _x(seed: int, B: int, T: int, D: int) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def _run(fn, where, x, block, **mask):
    out = fn(x, block, **mask)
    tensor_like(out, x.shape, where)
    return out


def _compare_block(fn, where, x, block, **mask):
    """The answer against the block itself; if they differ, the mistake it reproduces."""
    order = "pre-LN" if block.norm_first else "post-LN"
    got = _run(fn, where, x, block, **mask)
    with torch.no_grad():
        want = block(x, **mask)
    if torch.allclose(got.detach(), want, rtol=1e-4, atol=1e-4):
        return
    other = _other_order(block)
    with torch.no_grad():
        swapped = other(x, **mask)
    if torch.allclose(got.detach(), swapped, rtol=1e-4, atol=1e-4):
        raise AssertionError(f"{where}: this is the {'post' if block.norm_first else 'pre'}-LN "
                             f"order; the {order} block "
                             + ("normalises each sub-layer's input and adds its output to x"
                                if block.norm_first else
                                "adds each sub-layer's output to x, then normalises the sum"))
    if mask:
        with torch.no_grad():
            unmasked = block(x)
        if torch.allclose(got.detach(), unmasked, rtol=1e-4, atol=1e-4):
            raise AssertionError(f"{where}: the mask is ignored: pass attn_mask and is_causal "
                                 "on to block.self_attn")
    err = float((got.detach() - want).abs().max())
    raise AssertionError(f"{where}: differs from the {order} block by up to {err:.3g}")


def _other_order(block):
    """A copy of ``block`` with the other order of norms and residuals."""
    import copy
    other = copy.deepcopy(block)
    other.norm_first = not block.norm_first
    return other


def _padding(B: int, T: int, lengths) -> torch.Tensor:
    """(B, 1, 1, T): True where the key is a real token of its sequence."""
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]


@check_block.case("shapes")
def _(pre, post):
    for fn, norm_first in ((pre, True), (post, False)):
        for B, T, D, H in ((2, 5, 8, 2), (1, 3, 12, 3)):
            block = _book_block(1, D, H, 2 * D, norm_first)
            _run(fn, f"{fn.__name__}, x of shape {(B, T, D)}", _x(1, B, T, D), block)


@check_block.case("pre-LN, no mask")
def _(pre, post):
    _compare_block(pre, "pre_ln_block, x (2, 6, 16), H = 4", _x(2, 2, 6, 16),
                   _book_block(2, 16, 4, 32, True))


@check_block.case("pre-LN, causal")
def _(pre, post):
    _compare_block(pre, "pre_ln_block, is_causal=True", _x(3, 2, 7, 16),
                   _book_block(3, 16, 2, 24, True), is_causal=True)


@check_block.case("pre-LN, a padding mask")
def _(pre, post):
    _compare_block(pre, "pre_ln_block, attn_mask (3, 1, 1, 6), lengths 6, 4, 2", _x(4, 3, 6, 8),
                   _book_block(4, 8, 2, 16, True), attn_mask=_padding(3, 6, [6, 4, 2]))


@check_block.case("post-LN, no mask")
def _(pre, post):
    _compare_block(post, "post_ln_block, x (2, 6, 16), H = 4", _x(5, 2, 6, 16),
                   _book_block(5, 16, 4, 32, False))


@check_block.case("post-LN, a padding mask")
def _(pre, post):
    _compare_block(post, "post_ln_block, attn_mask (2, 1, 1, 5), lengths 3, 5", _x(6, 2, 5, 8),
                   _book_block(6, 8, 2, 16, False), attn_mask=_padding(2, 5, [3, 5]))


@check_block.case("post-LN, causal")
def _(pre, post):
    _compare_block(post, "post_ln_block, is_causal=True", _x(7, 1, 9, 12),
                   _book_block(7, 12, 3, 20, False), is_causal=True)


@check_block.case("train mode: the gradients reach the block's own weights")
def _(pre, post):
    for fn, norm_first in ((pre, True), (post, False)):
        block = _book_block(8, 8, 2, 16, norm_first).train()  # dropout 0: the same output
        x = _x(8, 2, 4, 8)
        where = f"{fn.__name__} in train mode"
        _compare_block(fn, where, x, block, is_causal=True)
        block.zero_grad()
        _run(fn, where, x, block, is_causal=True).pow(2).sum().backward()
        got = {name: p.grad for name, p in block.named_parameters()}
        reference = _book_block(8, 8, 2, 16, norm_first).train()
        reference(x, is_causal=True).pow(2).sum().backward()
        for name, p in reference.named_parameters():
            assert got[name] is not None, (
                f"{where}: no gradient reaches block.{name}: compute with the block's own "
                "parameters (no copies, no torch.no_grad, no .detach())")
            assert torch.allclose(got[name], p.grad, rtol=1e-3, atol=1e-4), (
                f"{where}: the gradient of block.{name} differs from the block's by up to "
                f"{float((got[name] - p.grad).abs().max()):.3g}")


@check_block.case("sizes and activations drawn at random")
def _(pre, post):
    g = torch.Generator().manual_seed(10)
    for _ in range(3):
        H = int(torch.randint(1, 4, (), generator=g))
        D = H * int(torch.randint(2, 6, (), generator=g))
        B, T = (int(n) for n in torch.randint(1, 5, (2,), generator=g))
        activation = ("relu", "gelu")[int(torch.randint(2, (), generator=g))]
        for fn, norm_first in ((pre, True), (post, False)):
            block = _book_block(int(torch.randint(100, (), generator=g)), D, H, 3 * D,
                                norm_first, activation)
            _compare_block(fn, f"{fn.__name__}, x {(B, T, D)}, H = {H}, {activation}",
                           _x(11, B, T, D), block, is_causal=bool(torch.randint(2, (), generator=g)))

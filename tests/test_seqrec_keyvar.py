"""The key variance of block 2 pulled back through block 1 (pipeline/seqrec/keyvar.py): its algebra
against autograd in the delta method's limit; its agreement with Monte Carlo on trained models is
tests/test_seqrec_reattention.py's (every block) and benchmarks/reattention_mc.py's (the full data)."""

import pytest
import torch
import torch.nn.functional as F

from pipeline.seqrec import reattention as ra

from test_seqrec_clipping import IDS, M


def _pullback(model, ids):
    """The Pullback block 1 leaves, and block 2's query directions a_t = W_k^T q_t and queries."""
    found = []
    block = ra.DPFormer._block

    def spy(self, *args, **kw):
        out = block(self, *args, **kw)
        found.append(out[2])
        return out

    record = []
    ra.DPFormer._block = spy
    try:
        with torch.no_grad():
            model(ids, record=record)
    finally:
        ra.DPFormer._block = block
    attn = model.blocks[1].attn
    q = record[1]["q"]
    h, dh = q.shape[1], q.shape[-1]
    return found[0], q @ attn.k.weight.view(h, dh, -1)[None], record


def _scramble(model, seed=3):
    """LayerNorm weights and biases away from (1, 0), so that every term has a non-trivial factor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            for ln in (block.ln1, block.ln2):
                ln.weight.copy_(0.5 + torch.rand(ln.weight.shape, generator=g, dtype=ln.weight.dtype))
                ln.bias.copy_(0.3 * torch.randn(ln.bias.shape, generator=g, dtype=ln.bias.dtype))
    return model


@pytest.mark.parametrize("path", ["pairs", "tokens"])
@pytest.mark.parametrize("heads", [1, 2])
def test_it_is_the_autograd_linearisation_of_block_1(heads, path):
    """In the delta method's limit (tiny noise: the expected scale is the noiseless one, the ReLU's
    expected slope its derivative), Var(a_t . y_s) is the sum over every noise source of its variance
    times the squared derivative of a_t . y_s: the input tokens' coordinates and block 1's weights,
    block 1's attention weights held at the forward's. W_v, used at every token, gets one copy per
    token (the propagation takes its noise independent between tokens, as the per-coordinate rule
    does); every other weight acts at token s only. Derivatives by autograd, one backward pass per
    (user, head, t, s)."""
    torch.manual_seed(1)
    model = ra.DPFormer(M, IDS.shape[1] + 1, d=8, heads=heads, blocks=2, d_ff=16, dropout=0.0, tied=True,
                        init_std=0.3).double()
    _scramble(model)
    tiny = 1e-7
    g = torch.Generator().manual_seed(4)
    items = tiny * (0.5 + torch.rand(M + 1, generator=g, dtype=torch.float64))
    items[0] = 0
    model.set_errors(tiny, items)
    pull, a, record = _pullback(model, IDS)
    have = pull.quadratic(a, path=path) / tiny**2  # (n, H, T, T), by either contraction

    x, mask, _ = model.inputs(IDS)
    x = x.detach().requires_grad_(True)
    block = model.blocks[0]
    attn = block.attn
    n, T, d = x.shape
    wv = attn.v.weight.detach().expand(T, d, d).clone().requires_grad_(True)  # one copy per token
    bv = attn.v.bias.detach().expand(T, d).clone().requires_grad_(True)
    v = torch.einsum("nji,joi->njo", x, wv) + bv
    y = block.ln1(x + attn.out(attn.merge(record[0]["att"] @ attn.split(v))))
    out = block.ln2(y + block.ff2(F.relu(block.ff1(y))))
    weights = [wv, bv] + [p for name, p in block.named_parameters() if not name.startswith(("attn.v.", "attn.q.",
                                                                                           "attn.k."))]
    var_in = ((items[IDS] ** 2 * mask)[..., None].expand_as(x) + model.block_err ** 2) / tiny**2
    H = a.shape[1]
    want = torch.zeros_like(have)
    for i in range(n):
        for hh in range(H):
            for t in range(T):
                for s in range(T):
                    grads = torch.autograd.grad(out[i, s] @ a[i, hh, t], [x] + weights, retain_graph=True)
                    want[i, hh, t, s] = ((grads[0] * grads[0] * var_in).sum()
                                         + sum((w * w).sum() for w in grads[1:]))
    # to 1e-4: at std 1e-7 the ReLU's expected slope Phi(mu / sigma) is its derivative to that, near mu = 0
    torch.testing.assert_close(have, want, rtol=1e-4, atol=0)
    assert want.min() > 0


def test_the_monte_carlo_benchmark_prints_and_writes_both_rules(tmp_path, capsys):
    """benchmarks/reattention_mc.py at a toy size (a made-up interactions file, two steps, five draws):
    block 1, and block 2 with its keys pulled back and by the per-coordinate rule, and both blocks of
    form=sampled, per median error."""
    import json

    from benchmarks import reattention_mc

    g = torch.Generator().manual_seed(0)
    lines = [f"{u} {int(i)}" for u in range(1, 31) for i in torch.randint(1, 40, (12,), generator=g)]
    data = tmp_path / "interactions.txt"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "mc.json"
    assert reattention_mc.main(["--data", str(data), "--steps", "2", "--batch", "4", "--medians", "0.05", "6",
                                "--users", "2", "--draws", "5", "--sample-draws", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["item_err_median"], r["block"], r["keys"]) for r in rows] == [
        (m, b, k) for m in (0.05, 6.0)
        for b, k in ((1, "pullback"), (2, "pullback"), (2, "per-coordinate"), (1, "sampled"), (2, "sampled"))]
    assert all(0 < r["q05"] <= r["median"] <= r["q95"] for r in rows)
    printed = capsys.readouterr().out
    assert "per-coordinate" in printed and "block 2 (sampled) within the targets" in printed
    assert reattention_mc.main(["--data", str(tmp_path / "missing.txt")]) == 2

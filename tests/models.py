"""Toy models for the pass tests, each written the way real model code writes it."""
import torch
import torch.nn.functional as F
from torch import nn

from fp8compile.demo import GatedMLP  # noqa: F401  (the Llama feed-forward, shared with the benchmark)

BF16 = torch.bfloat16


class Attention(nn.Module):
    """q/k/v/o projections around scaled_dot_product_attention; x is (B, S, H)."""

    def __init__(self, hidden=256, heads=4, bias=True):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden, bias=bias) for _ in range(3))
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h))


class TinyLM(nn.Module):
    """Embedding -> gated MLP -> lm_head over a 32000-token vocabulary."""

    def __init__(self, vocab=32000, hidden=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = GatedMLP(hidden, 512)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.mlp(self.embed(ids)))


class OddDims(nn.Module):
    """One linear that fits the block recipe, one with N=100, one with K=200."""

    def __init__(self):
        super().__init__()
        self.fits = nn.Linear(256, 256)
        self.odd_n = nn.Linear(256, 100)
        self.odd_k = nn.Linear(200, 128)

    def forward(self, x, y):
        return self.odd_n(self.fits(x)), self.odd_k(y)


class LinearForms(nn.Module):
    """The same kind of linear written six ways."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(256, 256) * 0.05)  # (N, K)
        self.b = nn.Parameter(torch.randn(256) * 0.05)
        self.w_kn = nn.Parameter(torch.randn(256, 384) * 0.05)  # (K, N), used as x @ w_kn
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        a = F.linear(x, self.w, self.b)
        b = a @ self.w.t()
        c = torch.matmul(b, self.w.T) + self.b
        d = self.lin(c)
        e = d @ self.w.transpose(0, 1)
        return e @ self.w_kn


class TwoLayer(nn.Module):
    """The model of the golden graph diff: linear(+bias) -> relu -> linear."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 256)
        self.fc2 = nn.Linear(256, 128, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class SiLUModuleMLP(GatedMLP):
    """The activation as a module (nn.SiLU), as transformers' ACT2FN["silu"] gives it."""

    def __init__(self):
        super().__init__()
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SigmoidMLP(GatedMLP):
    """silu written by hand: x * sigmoid(x)."""

    def forward(self, x):
        g = self.gate_proj(x)
        return self.down_proj(g * torch.sigmoid(g) * self.up_proj(x))


class FusedGateUpMLP(nn.Module):
    """Phi-3 style: one gate_up linear, halves split by `split` ("chunk"), `split` or slicing."""

    def __init__(self, how="chunk"):
        super().__init__()
        self.how = how
        self.gate_up_proj = nn.Linear(256, 1024, bias=False)
        self.down_proj = nn.Linear(512, 256, bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.how == "chunk":
            gate, up = gate_up.chunk(2, dim=-1)
        elif self.how == "split":
            gate, up = torch.split(gate_up, 512, dim=-1)
        else:
            gate, up = gate_up[..., :512], gate_up[..., 512:]
        return self.down_proj(up * F.silu(gate))


class GeluGatedMLP(GatedMLP):
    """A gated MLP with GELU: not fused (only silu is), and the report says so."""

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


class GptOssStyleMLP(nn.Module):
    """GPT-OSS's swigluoai activation (transformers' GptOssExperts._apply_gate) in a dense MLP,
    gate/up interleaved (gate_up[..., ::2], [..., 1::2]) or concatenated (chunk)."""

    def __init__(self, interleaved=True, alpha=1.702, limit=7.0):
        super().__init__()
        self.interleaved, self.alpha, self.limit = interleaved, alpha, limit
        self.gate_up_proj = nn.Linear(256, 1024)
        self.down_proj = nn.Linear(512, 256)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.interleaved:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return self.down_proj((up + 1) * glu)

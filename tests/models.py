"""Toy models for the pass tests, each written the way real model code writes it."""

import math

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
        q, k, v = (
            p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
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
    """One linear that fits the block recipe, one with N=100, one with K=200 (part of a 1x128
    group past 128) and one with K=64 (less than one group)."""

    def __init__(self):
        super().__init__()
        self.fits = nn.Linear(256, 256)
        self.odd_n = nn.Linear(256, 100)
        self.odd_k = nn.Linear(200, 128)
        self.short_k = nn.Linear(64, 128)

    def forward(self, x, y, z):
        return self.odd_n(self.fits(x)), self.odd_k(y), self.short_k(z)


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


class Fp32ProductMLP(GatedMLP):
    """The product in fp32 from the bf16 halves, cast back (Beam's experts compute theirs so)."""

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj((F.silu(gate.float()) * up.float()).to(x.dtype))


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
    """A gated MLP with GELU (erf): not fused (silu and gelu's tanh form are), and the report says so."""

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


class GeluTanhGatedMLP(GatedMLP):
    """Gemma's gated MLP, gelu(gate, approximate="tanh") * up: through F.gelu (transformers'
    gelu_pytorch_tanh) or written out as transformers' gelu_new writes it (pow(x, 3.0))."""

    def __init__(self, written_out: bool = False):
        super().__init__()
        self.written_out = written_out

    def forward(self, x):
        g = self.gate_proj(x)
        if self.written_out:
            act = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * torch.pow(g, 3.0))))
        else:
            act = F.gelu(g, approximate="tanh")
        return self.down_proj(act * self.up_proj(x))


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


class DeepseekV4StyleMLP(nn.Module):
    """DeepSeek-V4's shared expert (transformers' DeepseekV4MLP): silu(clamp(gate, max=l)) *
    clamp(up, -l, l), its swiglu_limit; up_clamped=False leaves up unclamped, which no fused
    activation computes."""

    def __init__(self, limit=10.0, up_clamped=True):
        super().__init__()
        self.limit, self.up_clamped = limit, up_clamped
        self.gate_proj = nn.Linear(256, 512, bias=False)
        self.up_proj = nn.Linear(256, 512, bias=False)
        self.down_proj = nn.Linear(512, 256, bias=False)

    def forward(self, x):
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x)
        if self.up_clamped:
            up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class GptFastMoE(nn.Module):
    """gpt-fast's MoE feed-forward: router, top-k, then expert weights gathered per token
    (w1[expert_ids]) and applied with einsum; w1 (gate) and w3 (up) separate."""

    def __init__(self, dim=256, inter=256, experts=8, top_k=2):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, inter, dim) * 0.02)
        self.w2 = nn.Parameter(torch.randn(experts, dim, inter) * 0.02)
        self.w3 = nn.Parameter(torch.randn(experts, inter, dim) * 0.02)
        self.top_k = top_k

    def forward(self, x):
        x = x.view(-1, x.shape[-1])
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        w1, w3, w2 = self.w1[ids], self.w3[ids], self.w2[ids]
        x1 = F.silu(torch.einsum("ti,taoi->tao", x, w1))
        x3 = torch.einsum("ti,taoi->tao", x, w3)
        out = torch.einsum("tao,taio->tai", x1 * x3, w2)
        return torch.einsum("tai,ta->ti", out, weights)


class MaskedGroupedMoE(nn.Module):
    """Routed experts over torch._grouped_mm the way transformers' "grouped_mm" experts do with
    expert-parallel sentinels: tokens sorted by expert, offsets from histc + cumsum, and rows
    routed to an id >= num_experts zeroed (masked_fill) before and after each grouped GEMM."""

    def __init__(self, dim=256, inter=256, experts=8, top_k=2):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, dim) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(experts, dim, inter) * 0.02)
        self.experts, self.top_k = experts, top_k

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        sorted_ids, perm = torch.sort(ids.reshape(-1))
        sentinel = (sorted_ids >= self.experts).unsqueeze(-1)
        offsets = torch.cumsum(
            torch.histc(sorted_ids.float(), bins=self.experts, min=0, max=self.experts - 1),
            0,
            dtype=torch.int32,
        )
        h = x[perm // self.top_k].masked_fill(sentinel, 0.0)
        gate_up = torch._grouped_mm(h, self.gate_up_proj.transpose(-2, -1), offs=offsets).masked_fill(
            sentinel, 0.0
        )
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets)
        out = out.masked_fill(sentinel, 0.0) * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=x.device)
        return out[inverse].view(x.shape[0], self.top_k, -1).sum(dim=1)


class ClampedBatchedMoE(nn.Module):
    """transformers 5.17's "batched_mm" experts (what generate() switches to for decode on a GPU):
    every token repeated top_k times, the flattened ids clamped to [0, clamp_max], the expert
    weights gathered per (token, expert) and applied with bmm."""

    def __init__(self, dim=256, inter=256, experts=8, top_k=2, clamp_max=None):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, dim) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(experts, dim, inter) * 0.02)
        self.top_k = top_k
        self.clamp_max = experts - 1 if clamp_max is None else clamp_max

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        h = x.repeat_interleave(self.top_k, dim=0)
        ids = ids.reshape(-1).clamp(0, self.clamp_max)
        gate_up = torch.bmm(self.gate_up_proj[ids], h.unsqueeze(-1)).squeeze(-1)
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.bmm(self.down_proj[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        out = out * weights.to(out.dtype).reshape(-1).unsqueeze(-1)
        return out.view(x.shape[0], self.top_k, -1).sum(dim=1)

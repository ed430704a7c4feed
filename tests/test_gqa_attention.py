"""The gqa_attention pass: transformers' grouped-query attention over a static cache reads each
K/V head once (no repeat_kv copy), with the numbers of the attention it replaces."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8compile
from fp8compile import calc_diff
from fp8compile.passes.gqa_attention import MAX_QUERY_ROWS, SDPA_OPS, grouped_sdpa, repeated_kv
from tests.conftest import golden_text

pytest.importorskip("transformers")
from fp8compile.bench.decode import static_cache  # noqa: E402
from fp8compile.demo import small_llama  # noqa: E402


def repeat_kv(x, rep):
    b, kv, length, d = x.shape
    return x[:, :, None].expand(b, kv, rep, length, d).reshape(b, kv * rep, length, d)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("mask", [None, "per_sequence", "per_head", "2d"])
@pytest.mark.parametrize("heads_outer", [True, False])
@pytest.mark.parametrize("kv, rep", [(2, 4), (4, 7), (1, 8)], ids=["llama", "qwen2.5", "mqa"])
def test_grouped_query_rows_give_the_attention_over_repeated_kv(rows, mask, heads_outer, kv, rep):
    b, heads, length, d = 2, kv * rep, 24, 16
    q, k, v = (torch.randn(b, n, s, d) for n, s in ((heads, rows), (kv, length), (kv, length)))
    bias = {
        None: None,
        "per_sequence": torch.randn(b, 1, rows, length),
        "per_head": torch.randn(b, heads, rows, length),
        "2d": torch.randn(rows, length),
    }[mask]
    want = F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), attn_mask=bias, scale=0.3)
    got = grouped_sdpa(q, k, v, bias, 0.3, rep, heads_outer)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # laid out as asked: (B, H, S, D) in memory, or (B, S, H, D) as the sdpa kernels write it
    in_memory_order = got if heads_outer else got.transpose(1, 2)
    assert in_memory_order.is_contiguous(), got.stride()


def _generate(model, ids, backend, steps=6):
    torch._dynamo.reset()
    model.forward = torch.compile(type(model).forward.__get__(model), backend=backend)
    try:
        cache = static_cache(model, ids.shape[0], ids.shape[1] + steps, "cpu")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            do_sample=False,
            past_key_values=cache,
            output_logits=True,
            return_dict_in_generate=True,
        )
    finally:
        del model.forward
    return out.sequences, out.logits


def test_static_cache_decode_reads_each_kv_head_once_with_the_numbers_of_repeat_kv(captured):
    model = small_llama(layers=1)  # 4 query heads on 2 K/V heads
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 32000, (2, 12))
    rewritten = fp8compile.backend(
        fusions=("gqa_attention",), skip=("*",)
    )  # linears stay bf16: attention only
    with torch.no_grad():
        tokens, logits = _generate(model, ids, rewritten)
        want_tokens, want_logits = _generate(model, ids, fp8compile.backend(fusions=(), skip=("*",)))
    layers = model.config.num_hidden_layers
    assert [(r.name, r.detail) for r in rewritten.report.rewrites if r.graph == 1] == [
        (f"model.layers.{i}.self_attn", "gqa 4/2 heads") for i in range(layers)
    ]
    for graph in captured[:2]:  # the prompt's graph and the decode step's
        sdpa = [node for node in graph.after.graph.nodes if node.target in SDPA_OPS]
        assert len(sdpa) == layers and all(node.args[1].meta["val"].shape[1] == 2 for node in sdpa)
        assert not [node for node in graph.after.graph.nodes if repeated_kv(node)], (
            "repeat_kv's copy is still there"
        )
    assert torch.equal(tokens, want_tokens)
    # The same softmax over the same keys, tiled differently: bf16 rounding of the output.
    assert max(calc_diff(a.float(), b.float()) for a, b in zip(logits, want_logits)) < 1e-4


def test_a_query_longer_than_the_grouped_rows_pay_for_keeps_repeat_kv_and_says_why():
    model = small_llama(layers=1)
    model.generation_config.eos_token_id = None
    backend = fp8compile.backend(fusions=("gqa_attention",), skip=("*",))
    with torch.no_grad():
        _generate(model, torch.randint(0, 32000, (1, MAX_QUERY_ROWS + 1)), backend, steps=2)
    (skip,) = [s for s in backend.report.skips if s.kind == "attention"]
    assert skip.name == "model.layers.0.self_attn" and f"<= {MAX_QUERY_ROWS}" in skip.reason
    assert [r.graph for r in backend.report.rewrites if r.kind == "attention"] == [1]  # the decode step's


def test_every_layers_attention_after_the_first_is_a_copy_of_its_trace(monkeypatch):
    """Tracing is most of a default-mode compile's time in our passes (passes/trace.py): the
    layers of a model repeat one signature, so a graph traces its attention once."""
    from fp8compile.passes import trace

    traced, real = [], trace._trace
    monkeypatch.setattr(trace, "_trace", lambda fn, vals: traced.append(fn) or real(fn, vals))
    model = small_llama(layers=2)
    model.generation_config.eos_token_id = None
    backend = fp8compile.backend(fusions=("gqa_attention",), skip=("*",))
    with torch.no_grad():
        _generate(model, torch.randint(0, 32000, (2, 5)), backend, steps=2)
    # The prompt (5 tokens, static) and the decode step: two layers each, one trace each.
    assert [r.graph for r in backend.report.rewrites if r.kind == "attention"] == [0, 0, 1, 1]
    assert len(traced) == 2


class DecodeAttention(nn.Module):
    """transformers' sdpa attention of one decode token over a cache: repeat_kv, then sdpa with a mask."""

    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(
            q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask, scale=0.125
        )


GOLDEN = Path(__file__).parent / "golden" / "gqa_attention.diff"


def test_golden_graph_diff_of_decode_attention_over_a_grouped_cache(pass_diffs):
    """4 query heads on 2 K/V heads, one query token: repeat_kv's unsqueeze/expand/clone/view
    chains leave, q and the mask are regrouped into rows of each K/V head, and the output is
    put back as (B, H, S, D). Regenerate with FP8COMPILE_UPDATE_GOLDEN=1 after an intended
    change, and read the diff."""
    q, k, v = torch.randn(2, 4, 1, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    mask = torch.rand(2, 1, 1, 16) > 0.3
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(
            DecodeAttention(), backend=fp8compile.backend(fusions=("gqa_attention",)), dynamic=False
        )(q, k, v, mask)
    torch.testing.assert_close(out, DecodeAttention()(q, k, v, mask), atol=1e-5, rtol=1e-5)
    (diff,) = pass_diffs
    assert diff == golden_text(GOLDEN, diff)

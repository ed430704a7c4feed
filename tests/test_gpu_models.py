"""Whole transformers models on the GPU, in both compile modes, with the default kernels: a dense
Llama (in bfloat16 and in float16), a Qwen3-MoE and a Llama 4 (dense experts) at small widths
(multiples of 128). Run with `pytest -m gpu`."""

import pytest
import torch

import fp8compile
from fp8compile import calc_diff
from tests.conftest import CountingBackend, gpu

pytestmark = [pytest.mark.gpu, gpu]
transformers = pytest.importorskip("transformers")

# tokens: every range of the default dispatch (32, and 2048 for these models' narrow outputs)
MS = [1, 3, 16, 33, 64, 300, 2049]
MODES = [None, "reduce-overhead"]


# What the three models share: widths that are multiples of 128, two layers, grouped-query attention.
SMALL = dict(
    vocab_size=32000,
    hidden_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def llama():
    config = transformers.LlamaConfig(**SMALL, intermediate_size=1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).cuda().eval()


def llama_float16():
    """The Llama in float16: rewritten as the bfloat16 one, its outputs float16 (tests/test_dtypes.py)."""
    return llama().half()


def qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        **SMALL,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=4,
        head_dim=128,
    )
    return _on_gpu_with_experts_drawn(transformers.Qwen3MoeForCausalLM, config)


def _on_gpu_with_experts_drawn(model_class, config):
    """The bf16 model on the GPU, its stacked expert parameters drawn N(0, 0.02): transformers
    leaves them uninitialised (Qwen3-MoE) or zero (Llama 4) at these sizes."""
    torch.manual_seed(0)
    model = model_class(config).to(torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.02)
    return model


def llama4():
    """Llama 4's text model: dense experts (every token through each expert's whole weight, the
    router's top-1 score scaling the inputs) in every layer, beside a shared expert."""
    config = transformers.Llama4TextConfig(
        **SMALL,
        intermediate_size=256,
        intermediate_size_mlp=1024,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        head_dim=128,
    )
    return _on_gpu_with_experts_drawn(transformers.Llama4ForCausalLM, config)


def ids_for(m: int) -> torch.Tensor:
    """m tokens: m sequences of one token up to 64 (decode-like), one sequence of m above."""
    return torch.randint(0, 32000, (m, 1) if m <= 64 else (1, m), device="cuda")


def dynamo_graphs(model) -> int:
    """How many graphs Dynamo compiles for the model over every M, with no backend of its own."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()  # a third backend on the same code would pass Dynamo's recompile limit
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, dynamic=True)
    with torch.no_grad():
        for m in MS:
            compiled(ids_for(m), use_cache=False)
    return counter.frame_count


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make", [llama, llama_float16, qwen3_moe, llama4])
def test_transformers_model_runs_every_range_of_m_in_both_modes_within_its_fp8_bound(make, mode):
    from torch._dynamo.utils import counters

    model = make()
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, mode=mode, dynamic=True)
    # the bound: the same model with the reference kernels (the definition of every op), compiled
    reference = torch.compile(model, backend=fp8compile.backend(backends=["reference"]), dynamic=True)
    counters.clear()
    with torch.no_grad():
        for m in MS:
            ids = ids_for(m)
            eager = model(ids, use_cache=False).logits.float()
            for _ in range(3 if mode else 1):  # reduce-overhead: warm-up, recording, replay
                torch.compiler.cudagraph_mark_step_begin()
                logits = compiled(ids, use_cache=False).logits.float()
            bound = calc_diff(reference(ids, use_cache=False).logits.float(), eager)
            assert calc_diff(logits, eager) < 1.15 * bound + 1e-4, f"M={m}"
        compiles = backend.compiles
        for m in MS:  # every M again: nothing recompiles
            compiled(ids_for(m), use_cache=False)
    assert backend.compiles == compiles
    counts = backend.report.counts()
    assert counts["linear"] > 0 and (counts["moe"] > 0) == (make in (qwen3_moe, llama4))
    if make in (llama, llama_float16):  # every linear and gated MLP of a dense Llama, in either dtype
        assert not backend.report.skipped("linear") and not backend.report.skipped("silu_mul")
    if mode:
        assert counters["inductor"]["cudagraph_skips"] == 0
        assert all(state.startswith("on:") for state in backend.report.cuda_graphs.values()), (
            backend.report.cuda_graphs
        )
    # and the backend adds no graph: Dynamo alone makes as many over the same calls (size 1 is
    # specialised: two shape families, times the graph breaks the model has of its own)
    assert compiles == dynamo_graphs(model)


@pytest.mark.parametrize("path", ["compile_config", "user_compile", "user_compile_lazy_cache"])
@pytest.mark.parametrize("make", [llama, llama_float16, qwen3_moe])
def test_generate_with_a_static_cache_in_cuda_graphs_does_not_recompile_after_warm_up(make, path):
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    from fp8compile.bench.decode import static_cache

    model = make()
    model.generation_config.eos_token_id = None
    backend = CountingBackend()
    if path == "compile_config":  # transformers compiles the decode step; the prompt runs eagerly
        kwargs = dict(compile_config=CompileConfig(backend=backend, mode="reduce-overhead"))
    else:  # the user's own compile: the prompt runs compiled too
        model.forward = torch.compile(model.forward, backend=backend, mode="reduce-overhead")
        kwargs = dict(disable_compile=True)
    counters.clear()
    with torch.no_grad():
        for batch in (1, 16):
            ids = torch.randint(0, 32000, (batch, 40), device="cuda")
            gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, **kwargs)
            cache = static_cache(model, batch, 72, "cuda") if path == "user_compile" else None

            def generate():
                if cache is None:
                    return model.generate(ids, cache_implementation="static", **gen)
                cache.reset()
                return model.generate(ids, past_key_values=cache, **gen)

            first = generate()
            warm = backend.compiles
            again = generate()
            assert backend.compiles == warm, f"batch {batch}: generate() recompiled after warm-up"
            assert torch.equal(first, again)
    states = backend.report.cuda_graphs.values()
    if (
        path != "user_compile_lazy_cache"
    ):  # the cache made before the first call (static_cache()) or by generate()
        assert counters["inductor"]["cudagraph_skips"] == 0
        assert all(state.startswith("on:") for state in states), backend.report.cuda_graphs
    else:
        # Left to generate(), the cache is first filled inside the compiled prompt, where its
        # position counter (cumulative_length) is still a CPU tensor: that graph runs without CUDA
        # graphs and the report names the input and says what to do.
        off = [state for state in states if not state.startswith("on:")]
        assert off and all(
            "cumulative_length" in state and "early_initialization" in state for state in off
        ), backend.report.cuda_graphs


def mistral_with_a_window(window: int = 4096):
    """Mistral-7B-v0.1's sliding window, longer than the sequences below: transformers' static
    cache then passes the position of its sliding layers to the compiled decode step as an int
    that moves every step (StaticSlidingWindowLayer.cumulative_length_int)."""
    config = transformers.MistralConfig(**SMALL, intermediate_size=1024, sliding_window=window)
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).to(torch.bfloat16).cuda().eval()


def _cuda_graph_recordings(monkeypatch) -> list:
    from torch._inductor import cudagraph_trees

    recorded = []
    real = cudagraph_trees.CUDAGraphTreeManager.record_function

    def record_function(self, *args, **kwargs):
        recorded.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", record_function)
    return recorded


def test_a_sliding_window_cache_records_no_more_cuda_graphs_than_bf16_inductor(monkeypatch):
    # Our graphs once compiled without Inductor's graph partitioning: a CUDA graph was recorded
    # again for every new value of the window's position, at every decode step (Mistral-7B-v0.1's
    # window at NeMo widths, 2 layers, H200: 10.6 tokens/s against bf16 Inductor's 331). Then a
    # second batch size, which makes the batch dynamic and brings the M dispatch's torch.conds:
    # whole graphs for those were recorded at every step too (8 layers, batch 16: 0.05x).
    from transformers.generation.configuration_utils import CompileConfig

    model = mistral_with_a_window()
    model.generation_config.eos_token_id = None
    recorded = _cuda_graph_recordings(monkeypatch)
    counts = {}
    with torch.no_grad():
        for name, backend in (("bf16", "inductor"), ("fp8", fp8compile.backend())):
            torch._dynamo.reset()
            config = CompileConfig(backend=backend, mode="reduce-overhead")
            for batch in (2, 3):
                ids = torch.randint(0, 32000, (batch, 24), device="cuda")
                gen = dict(attention_mask=torch.ones_like(ids), do_sample=False)
                gen.update(cache_implementation="static", compile_config=config)
                model.generate(ids, max_new_tokens=24, **gen)  # warm-up, recordings
                recorded.clear()
                model.generate(ids, max_new_tokens=24, **gen)
                counts[name, batch] = len(recorded)
    for batch in (2, 3):
        assert counts["fp8", batch] <= counts["bf16", batch] + 1, counts
    assert backend.report.counts()["linear"] > 0
    assert all(state.startswith("on:") for state in backend.report.cuda_graphs.values())


@pytest.mark.parametrize("make", [llama, mistral_with_a_window, qwen3_moe])
def test_lean_decode_in_cuda_graphs_gives_generates_tokens_and_compiles_nothing_on_a_second_call(make):
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    from fp8compile.lean_decode import LeanDecoder

    model = make()
    model.generation_config.eos_token_id = None
    backend = CountingBackend()
    ids = torch.randint(0, 32000, (2, 24), device="cuda")
    counters.clear()
    with torch.no_grad():
        config = CompileConfig(backend=backend, mode="reduce-overhead")
        expected = model.generate(
            ids, max_new_tokens=24, do_sample=False, cache_implementation="static", compile_config=config
        )
        decoder = LeanDecoder(model, backend=backend, mode="reduce-overhead")
        first = decoder.generate(ids, 24)
        warm = backend.compiles
        again = decoder.generate(ids, 24)
    assert backend.compiles == warm
    assert torch.equal(first, again)
    assert torch.equal(first, expected)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert all(state.startswith("on:") for state in backend.report.cuda_graphs.values())


@pytest.mark.parametrize("window", [4096, 16])  # holding the 48-token cache, and not
def test_lean_decode_of_a_sliding_window_records_its_cuda_graphs_once(monkeypatch, window):
    # Built inside the compiled step, the masks of a sliding-window layer take its position, a
    # Python int that moves every step, into the graph's kernels: CUDA graphs were then recorded
    # once per value, every step of the second call (Mistral-7B-v0.1, 32 layers, H200: 105 ms a
    # step). LeanDecoder's cache has no such layer (a plain static one, or a ring_window one).
    from transformers.generation.configuration_utils import CompileConfig

    from fp8compile.lean_decode import LeanDecoder

    model = mistral_with_a_window(window)
    model.generation_config.eos_token_id = None
    recorded = _cuda_graph_recordings(monkeypatch)
    ids = torch.randint(0, 32000, (1, 24), device="cuda")
    with torch.no_grad():
        for backend in ("inductor", fp8compile.backend()):
            torch._dynamo.reset()
            decoder = LeanDecoder(model, backend=backend, mode="reduce-overhead")
            first = decoder.generate(ids, 24)
            recorded.clear()
            for _ in range(2):
                assert torch.equal(decoder.generate(ids, 24), first)
            assert not recorded, f"{backend}: {len(recorded)} CUDA graphs recorded after the first call"
            config = CompileConfig(backend=backend, mode="reduce-overhead")
            expected = model.generate(
                ids, max_new_tokens=24, do_sample=False, cache_implementation="static", compile_config=config
            )
            assert torch.equal(first, expected)

"""LeanDecoder: transformers models decoded by one compiled call a step with no host sync between
steps, giving generate()'s tokens (fp8compile/lean_decode.py)."""

import pytest
import torch

import fp8compile
from fp8compile import architectures
from fp8compile.lean_decode import ARGMAX_CHUNK, LeanDecoder, Sampling, argmax_rows, choose

pytest.importorskip("transformers")
from torch._dynamo.utils import counters  # noqa: E402
from transformers.generation.configuration_utils import CompileConfig  # noqa: E402


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _prompt(model, batch=2, length=10):
    ids = torch.randint(3, model.config.vocab_size, (batch, length))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt left-padded by three tokens
    return ids, mask


def _built(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


def _twice_against_generate(model, decoder, ids, mask, backend):
    """generate()'s tokens (20 new ones), LeanDecoder's from two calls, and the graphs Dynamo
    compiled for those two calls."""
    with torch.no_grad():
        expected = _generate(model, ids, backend, attention_mask=mask, max_new_tokens=20)
        torch._dynamo.reset()
        before = _graphs()
        calls = [decoder.generate(ids, 20, attention_mask=mask) for _ in range(2)]
    return expected, calls, _graphs() - before


def _generate(model, ids, backend, **options):
    """model.generate() as a user runs it: static cache, its decode step compiled with backend."""
    config = CompileConfig(backend=backend, mode="default", dynamic=None)
    config._compile_all_devices = True  # transformers compiles the step on GPUs only otherwise
    return model.generate(
        ids, do_sample=False, cache_implementation="static", pad_token_id=0, compile_config=config, **options
    )


@pytest.mark.parametrize(
    "arch, fp8",
    [
        ("llama", True),
        ("mistral", True),  # every layer a sliding window, shorter than prompt + new tokens
        ("gemma2", False),  # sliding and global layers, softcapped logits
    ],
)
def test_greedy_lean_decode_gives_generates_tokens_with_left_padding_and_an_end_token(arch, fp8):
    model = architectures.build(arch).eval()
    ids, mask = _prompt(model)
    backend = fp8compile.backend() if fp8 else "eager"
    with torch.no_grad():
        expected = _generate(model, ids, backend, attention_mask=mask, max_new_tokens=20)
        eos = int(expected[0, 10 + 3])  # the first sequence's fourth new token ends it
        expected_eos = _generate(
            model, ids, backend, attention_mask=mask, max_new_tokens=20, eos_token_id=eos
        )
        torch._dynamo.reset()
        decoder = LeanDecoder(model, backend=backend, mode=None)
        assert torch.equal(decoder.generate(ids, 20, attention_mask=mask), expected)
        ended = decoder.generate(ids, 20, attention_mask=mask, eos_token_id=eos, pad_token_id=0, stop_every=2)
    assert torch.equal(ended, expected_eos)
    assert (ended[0, 10 + 4 :] == 0).all()  # padding after the end token


@pytest.mark.parametrize(
    "arch",
    [
        "deepseek_v3",  # MLA: keys and values of different widths in the cache
        "nemotron_h",  # hybrid: recurrent layers beside attention ones, reading the prompt's mask
        "gpt_bigcode",  # one KV head
        "bloom",  # ALiBi, built from the padding mask
        "gpt2",  # learned absolute positions
    ],
)
def test_lean_decode_gives_generates_tokens_whatever_the_cache_and_positions(arch):
    model = architectures.build(arch).eval()
    model.generation_config.eos_token_id = None
    ids, mask = _prompt(model)
    with torch.no_grad():
        expected = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )
        got = LeanDecoder(model, backend="eager", mode=None).generate(ids, 6, attention_mask=mask)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch, fp8", [("mistral", True), ("gemma2", False)])
def test_inside_its_windows_a_sliding_model_builds_its_masks_in_the_one_compiled_step(arch, fp8, monkeypatch):
    # The window (64) holds the prompt and every new token: the cache's layers are plain static
    # ones, and each step builds its masks in the graph, from the cache's tensor position. A
    # window shorter than the sequences is a ring (the test below).
    from transformers.cache_utils import StaticLayer

    config = architectures.small_config(arch)
    config.sliding_window = 64
    model = _built(config)
    ids, mask = _prompt(model)
    backend = fp8compile.backend() if fp8 else "eager"
    decoder = LeanDecoder(model, backend=backend, mode=None)
    built = []
    monkeypatch.setattr(decoder, "_masks", lambda *args: built.append(args))
    expected, calls, graphs = _twice_against_generate(model, decoder, ids, mask, backend)
    assert all(torch.equal(got, expected) for got in calls)
    assert not built
    assert graphs == 1  # no recompile as the position moves
    assert all(type(layer) is StaticLayer for layer in decoder.cache(2, 30).layers)


@pytest.mark.parametrize("arch, fp8", [("mistral", True), ("gemma2", False)])
@pytest.mark.parametrize("prompt", [10, 20])  # shorter and longer than the window (16)
def test_a_window_shorter_than_the_cache_is_a_ring_written_one_slot_a_step(arch, fp8, prompt):
    # SMALL's 16-token window, a 30- or 40-token cache: transformers' layer would roll the
    # window every step once it is full, and build the masks on the host; the ring layer
    # writes one slot, and the step builds its masks, one graph from the first step past the
    # prompt to the last, across the window's filling.
    from fp8compile import ring_window

    model = architectures.build(arch).eval()
    model.generation_config.eos_token_id = None
    ids, mask = _prompt(model, length=prompt)
    backend = fp8compile.backend() if fp8 else "eager"
    decoder = LeanDecoder(model, backend=backend, mode=None)
    expected, calls, graphs = _twice_against_generate(model, decoder, ids, mask, backend)
    assert all(torch.equal(got, expected) for got in calls)
    assert graphs == 1
    layers = decoder.cache(2, prompt + 20).layers
    rings = [layer for layer in layers if isinstance(layer, ring_window.layer_class())]
    assert rings and all(layer.keys.shape[2] == 16 for layer in rings)


def test_a_model_whose_masks_cannot_be_reordered_keeps_transformers_sliding_layers():
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    from fp8compile.lean_decode import static_cache
    from fp8compile.ring_window import layer_class

    config = architectures.small_config("gemma2")
    config.sliding_window = 64
    model = _built(config)
    kinds = {type(layer) for layer in static_cache(model, 65).layers}
    assert kinds == {layer_class(), StaticLayer}  # Gemma-2's global layers stay static
    assert {type(layer) for layer in static_cache(model, 64).layers} == {StaticLayer}
    model.config._attn_implementation = "flex_attention"  # block masks: no gather
    kinds = {type(layer) for layer in static_cache(model, 65).layers}
    assert kinds == {StaticSlidingWindowLayer, StaticLayer}


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_the_ring_takes_each_slots_column_of_the_mask_over_positions(dtype):
    from fp8compile.ring_window import ring_order

    # two sequences, a cache of 12 positions, the second left-padded by 3; a window of 4
    torch.manual_seed(0)
    over = torch.rand(2, 1, 1, 12) < 0.7
    over[1, ..., :3] = False
    if dtype is not torch.bool:
        over = torch.where(over, 0.0, torch.finfo(dtype).min).to(dtype)
    minimum = torch.finfo(dtype).min if dtype is not torch.bool else False
    for position in range(12):
        ring = ring_order(over, torch.tensor([position]), 4)
        for slot in range(4):
            held = [p for p in range(position + 1) if p % 4 == slot and p > position - 4]
            if held:  # the position this slot holds, the newest one written there
                assert torch.equal(ring[..., slot], over[..., held[0]])
            else:  # not written yet
                assert (ring[..., slot] == minimum).all()


def test_a_second_call_of_the_same_shape_compiles_nothing_and_the_step_is_one_graph():
    model = architectures.build("llama").eval()
    ids, _ = _prompt(model)
    decoder = LeanDecoder(model, backend=fp8compile.backend(), mode=None)
    with torch.no_grad():
        before = _graphs()
        first = decoder.generate(ids, 8)
        compiled = _graphs() - before
        second = decoder.generate(ids, 8)
        shorter = decoder.generate(ids, 5, cache_length=ids.shape[1] + 8)  # the same cache
    assert compiled == 1  # forward and argmax in one graph: no graph break
    assert _graphs() - before == compiled
    assert torch.equal(first, second)
    assert torch.equal(shorter, first[:, : ids.shape[1] + 5])


def test_a_compiled_prompt_gives_the_eager_prompts_tokens_from_a_cache_made_before_it():
    model = architectures.build("llama").eval()
    ids, mask = _prompt(model)
    with torch.no_grad():
        eager = LeanDecoder(model, backend="eager", mode=None).generate(ids, 8, attention_mask=mask)
        decoder = LeanDecoder(model, backend="eager", mode=None, compile_prefill=True)
        compiled = decoder.generate(ids, 8, attention_mask=mask)
    assert torch.equal(compiled, eager)
    layer = decoder.cache(2, 18).layers[0]
    assert layer.is_initialized and layer.keys.shape == (2, 2, 18, 64)  # made from the config


def test_every_sequence_ended_stops_the_loop_at_the_next_check():
    model = architectures.build("llama").eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 6))
    decoder = LeanDecoder(model, backend="eager", mode=None)
    with torch.no_grad():
        free = decoder.generate(ids, 40)
        eos = int(free[0, 6 + 2])  # the third new token
        calls = []
        ended = decoder.generate(ids, 40, eos_token_id=eos, stop_every=4, on_step=lambda: calls.append(1))
    assert torch.equal(ended, free[:, : 6 + 3])  # up to and with the end token, as generate() returns it
    assert len(calls) == 3  # steps 2, 3, 4 after the prompt's token; checked at 4 of 40


@pytest.mark.parametrize("vocab", [50, 2 * ARGMAX_CHUNK + 1, 128256])
def test_the_greedy_choice_in_chunks_is_torchs_argmax_ties_and_nans_included_eager_and_compiled(vocab):
    """argmax_rows reduces a long row in chunks (a program each on the GPU) and must give the index
    torch.argmax gives: the first of equal maxima even when they sit in different chunks, a NaN
    where there is one, 0 for a row of -inf; a vocabulary that is not a whole number of chunks."""
    torch.manual_seed(0)
    x = torch.randn(5, vocab)
    x[1] = 0.0
    x[2, vocab // 2] = x[2, vocab - 1] = 100.0
    x[3] = float("-inf")
    x[4, 7] = float("nan")
    expected = x.argmax(dim=-1)
    assert expected[2] == vocab // 2 and expected[4] == 7
    assert torch.equal(argmax_rows(x), expected)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(argmax_rows, backend="inductor", fullgraph=True)(x), expected)


def test_sampling_with_top_k_one_or_a_tiny_top_p_is_greedy():
    logits = torch.randn(4, 50)
    greedy = logits.argmax(-1)
    assert torch.equal(choose(logits, Sampling(do_sample=True, top_k=1)), greedy)
    assert torch.equal(choose(logits, Sampling(do_sample=True, top_p=1e-6)), greedy)


def test_top_k_and_top_p_keep_the_tokens_transformers_keeps():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(8, 64) * 3
    for temperature, top_k, top_p in [(0.7, 10, None), (1.0, None, 0.8), (1.3, 20, 0.5)]:
        theirs = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            theirs = TopKLogitsWarper(top_k)(None, theirs)
        if top_p:
            theirs = TopPLogitsWarper(top_p)(None, theirs)
        kept = torch.isfinite(theirs)
        torch.manual_seed(0)
        draws = torch.stack(
            [choose(logits, Sampling(True, temperature, top_k, top_p)) for _ in range(400)], dim=1
        )
        drawn = torch.zeros_like(kept).scatter_(1, draws, True)
        assert not (drawn & ~kept).any()  # nothing outside transformers' set is ever drawn
        # and its most likely kept tokens are drawn (each has probability >= 1/64 here)
        assert drawn[torch.arange(8), theirs.argmax(-1)].all()


def test_a_draw_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    torch.manual_seed(0)
    counts = torch.bincount(choose(logits, Sampling(do_sample=True)), minlength=4) / 20000
    # 20000 draws: each frequency within 4 standard deviations (at most 0.0035) of its probability
    assert torch.allclose(counts, probs, atol=0.015)


def test_sampled_decode_repeats_under_the_same_seed():
    model = architectures.build("llama").eval()
    ids, mask = _prompt(model)
    decoder = LeanDecoder(model, backend="eager", mode=None)
    with torch.no_grad():
        runs = []
        for seed in (1, 1, 2):
            torch.manual_seed(seed)
            runs.append(decoder.generate(ids, 12, attention_mask=mask, do_sample=True, top_p=0.9))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_bad_arguments_are_refused_with_a_reason():
    model = architectures.build("llama").eval()
    decoder = LeanDecoder(model, backend="eager", mode=None)
    ids = torch.randint(3, 100, (1, 4))
    with pytest.raises(ValueError, match="top_p"):
        decoder.generate(ids, 4, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate(ids, 0)
    with pytest.raises(ValueError, match="cache_length"):
        decoder.generate(ids, 4, cache_length=7)
    with pytest.raises(ValueError, match=r"\(batch, prompt length\)"):
        decoder.generate(ids[0], 4)


def test_a_model_without_a_static_cache_is_sent_to_generate():
    model = architectures.build("llama").eval()
    model._can_compile_fullgraph = False  # as transformers marks models that cannot
    with pytest.raises(ValueError, match="model.generate"):
        LeanDecoder(model)


def test_logits_processors_the_generation_config_asks_for_are_named_in_a_warning():
    model = architectures.build("llama").eval()
    model.generation_config.forced_eos_token_id = 2
    model.generation_config.repetition_penalty = 1.0  # its off value: not named
    with pytest.warns(UserWarning, match=r"asks for forced_eos_token_id=2, which LeanDecoder does not apply"):
        LeanDecoder(model)

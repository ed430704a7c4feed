"""Fp8Config(release_bf16_weights=True): the compiled graphs read rewritten linears' FP8 copies
only, so the bf16 weights' memory is given back; nothing is lost, and the eager model says what
to do instead of reading freed memory."""

import pytest
import torch

import fp8compile
from fp8compile import release
from tests.conftest import BF16
from tests.models import TinyLM


@pytest.fixture(autouse=True)
def restore_after():
    yield
    fp8compile.restore_bf16_weights()


def _model():
    torch.manual_seed(0)
    return TinyLM(vocab=1024).to(BF16).eval()


def test_released_weights_give_the_same_numbers_through_recompiles_and_the_embedding_stays():
    model, ids = _model(), torch.randint(0, 1024, (1, 5))
    kept = torch.compile(model, backend=fp8compile.backend(), dynamic=False)
    freed = torch.compile(model, backend=fp8compile.backend(release_bf16_weights=True), dynamic=False)
    with torch.no_grad():
        expected = [kept(x) for x in (ids, ids[:, :3])]
        got = freed(ids)
        rewritten = [
            model.mlp.gate_proj.weight,
            model.mlp.up_proj.weight,
            model.mlp.down_proj.weight,
            model.lm_head.weight,
        ]
        assert all(release.is_released(w) and w.untyped_storage().nbytes() == 0 for w in rewritten)
        assert not release.is_released(model.embed.weight)  # the graph reads it in bf16
        got = [
            got,
            freed(ids[:, :3]),
        ]  # a new static shape: Dynamo traces again, the passes see released weights
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_an_eager_call_of_a_released_module_is_lent_its_values_for_the_call_and_warns_once(
    caplog, monkeypatch
):
    """generate()'s prompt runs eagerly beside a compiled decode step: an eager call of a module
    whose bf16 weights were released gets the model's own numbers, its weights copied in from host
    memory for the call and freed again after it, with one warning that says how to avoid the copy;
    restore_bf16_weights() brings them back for good."""
    model, ids = _model(), torch.randint(0, 1024, (2, 4))
    with torch.no_grad():
        eager = model(ids)
        compiled = torch.compile(model, backend=fp8compile.backend(release_bf16_weights=True))
        out = compiled(ids)
        weight = model.lm_head.weight
        assert release.is_released(weight) and weight.untyped_storage().nbytes() == 0
        monkeypatch.setattr(release, "_warned", False)  # whichever test ran an eager call before
        with caplog.at_level("WARNING", logger="fp8compile.release"):
            assert torch.equal(model(ids), eager)
            assert torch.equal(model(ids), eager)
        warnings = [r.getMessage() for r in caplog.records if r.name == "fp8compile.release"]
        assert len(warnings) == 1 and "compile model.forward itself" in warnings[0]
        assert release.is_released(weight) and weight.untyped_storage().nbytes() == 0
        assert torch.equal(compiled(ids), out)
        assert fp8compile.restore_bf16_weights() > 0
        assert torch.equal(model(ids), eager)  # the same values, back in the same tensors
        assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()


def test_an_eager_call_that_raises_still_frees_what_it_was_lent():
    model, ids = _model(), torch.randint(0, 1024, (1, 4))
    with torch.no_grad():
        torch.compile(model, backend=fp8compile.backend(release_bf16_weights=True))(ids)
        weight = model.lm_head.weight
        with pytest.raises(RuntimeError):
            model.lm_head(torch.randn(3, 7, dtype=BF16))  # the wrong width: the forward raises
        assert release.is_released(weight) and weight.untyped_storage().nbytes() == 0
        assert release._LENT.get(model.lm_head) == []


def test_a_parameter_read_in_bf16_by_a_later_graph_is_brought_back_and_kept():
    """A released weight a graph compiled later reads in bf16 (here: that graph skips the
    lm_head) is made resident again before that graph runs, and never released after."""
    model, ids = _model(), torch.randint(0, 1024, (1, 4))
    with torch.no_grad():
        expected = model(ids)
        torch.compile(model, backend=fp8compile.backend(release_bf16_weights=True))(ids)
        assert release.is_released(model.lm_head.weight)
        torch._dynamo.reset()
        out = torch.compile(model, backend=fp8compile.backend(release_bf16_weights=True, skip=("lm_head",)))(
            ids
        )
        assert not release.is_released(model.lm_head.weight)
        assert torch.equal(model.lm_head.weight, _model().lm_head.weight)
    assert fp8compile.calc_diff(out.float(), expected.float()) < 0.02


def test_generate_with_a_compile_config_runs_its_eager_prompt_on_released_weights():
    """transformers' generate() with a CompileConfig compiles the decode step only and runs the
    prompt eagerly, before the step's first compile (which releases the weights): from the second
    call on, with release_bf16_weights, that prompt is lent the released weights, and the tokens
    are those of the same generate() without the release."""
    from transformers.generation.configuration_utils import CompileConfig

    from fp8compile.demo import small_llama

    model = small_llama(layers=1)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 32000, (2, 6))

    def generate(**options):
        config = CompileConfig(backend=fp8compile.backend(**options))
        config._compile_all_devices = True  # transformers compiles generate() on GPUs only otherwise
        torch._dynamo.reset()
        fp8compile.drop_fp8_weights()
        return [
            model.generate(
                ids, max_new_tokens=4, do_sample=False, cache_implementation="static", compile_config=config
            )
            for _ in range(2)
        ]

    with torch.no_grad():
        kept = generate()
        freed = generate(release_bf16_weights=True)
    down = model.model.layers[0].mlp.down_proj.weight
    assert release.is_released(down) and down.untyped_storage().nbytes() == 0
    assert all(torch.equal(a, b) for a, b in zip(freed, kept))


def test_a_stacked_experts_parameter_goes_to_host_memory_once_not_once_an_expert(monkeypatch):
    """Dense experts split into one FP8 linear per expert (passes/moe_dense.py) quantize one
    expert's slice of a stacked parameter at a time. Released as each copy is made, the whole
    parameter would come back and go again once an expert: it is released once, after the
    passes, and the numbers are those of the same model compiled without releasing."""
    pytest.importorskip("transformers")
    from fp8compile import weights
    from tests.conftest import randn
    from tests.test_moe import DenseMixture, compile_block

    torch.manual_seed(0)
    model, x = DenseMixture(experts=4).to(BF16), randn(9, 256)
    kept, _, _ = compile_block(model, x.clone())
    released = []
    release_once = release.release

    def counted(params):
        params = list(params)
        released.extend(id(p) for p in params if not release.is_released(p))
        return release_once(params)

    monkeypatch.setattr(release, "release", counted)
    torch._dynamo.reset()
    weights.forget()  # each expert quantized again, as in a first compile
    out, eager, report = compile_block(model, x.clone(), release_bf16_weights=True)
    assert report.counts()["linear"] == 8  # 4 experts x (gate|up, down)
    stacked = (model.gate_up_proj, model.down_proj)
    assert all(release.is_released(p) for p in stacked)
    assert [released.count(id(p)) for p in stacked] == [1, 1]
    assert torch.equal(out, kept)


def test_an_embedding_tied_to_a_rewritten_lm_head_keeps_its_weight_where_it_runs_outside_the_graphs():
    """JetMoE's embedding, tied to its lm_head, runs where Dynamo falls back to eager (its
    data-dependent breaks), outside every fp8 graph, so no graph pins it; and inside Dynamo's
    compiled code the eager lend hook runs with is_compiling() True and lends nothing. A
    parameter that two modules hold is never released (release.shared): the second call read
    freed storage before."""
    from transformers import CONFIG_MAPPING

    from fp8compile import architectures

    if "jetmoe" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no JetMoE")
    model = architectures.build("jetmoe")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend=fp8compile.backend(inductor=False, release_bf16_weights=True))
    with torch.no_grad():
        first = compiled(ids).logits
        assert torch.equal(compiled(ids).logits, first)
    assert not release.is_released(model.lm_head.weight)
    assert release.is_released(model.model.layers[0].mlp.output_linear.weight)  # an untied one goes

"""Tensor parallelism: a model sharded with PyTorch's DTensor tensor parallelism
(parallelize_module with ColwiseParallel / RowwiseParallel, or transformers' own TP plan), then
compiled with backend="fp8", on 2 CPU processes over gloo.

- Every sharded linear is rewritten on this rank's shard (column-sharded: its N slice;
  row-sharded: its K slice, the all-reduce left where DTensor put it); gate_up, qkv and silu_mul
  fuse the local shards; routed experts sharded within each expert are rewritten too.
- A shard that splits a 128-wide activation group stays bf16, its reason naming the shard.
- Every rank takes the same decisions and compiles the same graph (the report's digests, which
  leave numbers out: a vocab-sharded embedding's offsets are each rank's own).
- The logits stay within the FP8 bound (below) at every M, without a recompile.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fp8compile
from fp8compile import calc_diff, release, shards
from fp8compile.backend import FP8COMPILE_ALL_REDUCE, FP8COMPILE_ALL_REDUCE_NORM
from fp8compile.passes.all_reduce import NO_CUDA_GRAPHS

pytest.importorskip("transformers")
from fp8compile.demo import GatedMLP, small_llama  # noqa: E402
from tests import ranks  # noqa: E402
from tests.conftest import TINY_BENCH  # noqa: E402
from tests.test_llama import fp8_simulated  # noqa: E402

# Its tests share one spawn of WORLD processes (scenario_ranks, a module fixture): README's test
# command runs each file on one xdist worker (--dist loadfile), so that the spawn runs once.
WORLD = 2
SEQ_LENS = (1, 3, 17, 40)  # M = 2 * S rows: across the small-M threshold and back


def _entry(rank: int, fn, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks beside the other test worker, on two cores
    # What torchrun sets (transformers' TP plan reads the world from it)
    world = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=WORLD, LOCAL_WORLD_SIZE=WORLD)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{k: str(v) for k, v in world.items()})
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.save(fn(rank, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, tmp_path, *args) -> list[dict]:
    """fn(rank, *args) on WORLD processes of one gloo group, on the CPU; what each returned, by rank."""
    # Hidden from the workers, whatever GPUs there are (transformers' TP plan would take rank r to
    # cuda:r on a GPU machine, which may have one).
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        mp.spawn(_entry, args=(fn, ranks.free_port(), str(tmp_path), args), nprocs=WORLD)
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _tp_llama_plan(model) -> None:
    """Megatron's layout: q, k, v, gate, up column-sharded, o and down row-sharded (their
    all-reduce after), lm_head column-sharded with its logits gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{proj}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def _report_summary(report) -> dict:
    return {
        "counts": report.counts(),
        "rewrites": list(report.rewrites),
        "skips": list(report.skips),
        "digests": dict(report.digests),
        "rank": report.rank,
        "text": str(report),
    }


def _llama_with_references():
    """The workers' one-layer Llama (hidden 512, 8 heads of 64, 4 KV heads, intermediate 1024:
    every shard a whole number of 128-blocks), token ids of each of SEQ_LENS, and the unsharded
    model's logits for them: bf16 eager, and its FP8 composition (the bound)."""
    model = small_llama(vocab=1024, hidden=512, intermediate=1024, layers=1)
    gen = torch.Generator().manual_seed(0)
    ids = {s: torch.randint(0, 1024, (2, s), generator=gen) for s in SEQ_LENS}
    with torch.no_grad():
        bf16 = {s: model(x).logits for s, x in ids.items()}
        simulated = {s: fp8_simulated(model)(x).logits for s, x in ids.items()}
    return model, ids, bf16, simulated


def _llama_worker(rank: int) -> dict:
    """The one-layer Llama (_llama_with_references) sharded with parallelize_module, compiled at dynamic
    shapes with the three-range M dispatch; logits at each M against the unsharded model's
    eager bf16 and its FP8 composition."""
    from tests.conftest import RANGES, register_ranged_references

    model, ids, bf16, simulated = _llama_with_references()
    _tp_llama_plan(model)
    fp8 = fp8compile.backend(backends=register_ranged_references(), **RANGES)
    compiled = torch.compile(model, backend=fp8, dynamic=True)
    logits, compiled_after = {}, []
    with torch.no_grad():
        for s, x in ids.items():  # S = 1 is a graph of its own (sizes 0 and 1 are specialized)
            logits[s] = compiled(x).logits
            compiled_after.append(len(fp8.report.digests))
        tp_bf16 = model(ids[SEQ_LENS[-1]]).logits
    return {
        **_report_summary(fp8.report),
        "compiled_after": compiled_after,
        "diff": {s: calc_diff(logits[s], bf16[s]) for s in SEQ_LENS},
        "bound": {s: calc_diff(simulated[s], bf16[s]) for s in SEQ_LENS},
        "tp_bf16": calc_diff(tp_bf16, bf16[SEQ_LENS[-1]]),
        "logits": logits[SEQ_LENS[-1]],
    }


def _local_worker(rank: int) -> dict:
    """The one-layer Llama of _llama_worker sharded into plain local shards with functional
    collectives (fp8compile.tensor_parallel), compiled at dynamic shapes in reduce-overhead (the
    all_reduce pass rewrites graphs meant for CUDA graphs; the CPU records none): what Dynamo
    handed the backend (its placeholders, its collectives), the rewrites, and the logits at each M
    against the unsharded model's eager bf16 and its FP8 composition."""
    from torch.distributed.tensor import DTensor

    from fp8compile import tensor_parallel

    model, ids, bf16, simulated = _llama_with_references()
    tensor_parallel.shard(model)
    fp8, graphs = fp8compile.backend(), []

    def backend(gm, example_inputs, **options):  # options: the compile mode's, for fp8's Inductor
        graphs.append(
            {
                "collectives": sorted({str(n.target) for n in gm.graph.nodes if "c10d" in str(n.target)}),
                "dtensors": sum(isinstance(x, DTensor) for x in example_inputs),
            }
        )
        return fp8(gm, example_inputs, **options)

    compiled = torch.compile(model, backend=backend, dynamic=True, mode="reduce-overhead")
    with torch.no_grad():
        logits = {s: compiled(x).logits.clone() for s, x in ids.items()}
        tp_bf16 = model(ids[SEQ_LENS[-1]]).logits
    return {
        **_report_summary(fp8.report),
        "graphs": graphs,
        "kv_heads": tensor_parallel.local_kv_heads(model),
        "diff": {s: calc_diff(logits[s], bf16[s]) for s in SEQ_LENS},
        "bound": {s: calc_diff(simulated[s], bf16[s]) for s in SEQ_LENS},
        "tp_bf16": calc_diff(tp_bf16, bf16[SEQ_LENS[-1]]),
        "logits": logits[SEQ_LENS[-1]],
    }


def _built_shard_worker(rank: int) -> dict:
    """bench model's preset built as this rank's shard alone (made on the meta device, sharded
    there, then made on the CPU), beside the same preset built whole."""
    from fp8compile import tensor_parallel
    from fp8compile.bench.presets import build

    whole = build("tiny-llama", 1, "cpu")
    model = build("tiny-llama", 1, "cpu", shard=tensor_parallel.shard)
    layer, whole_layer = model.model.layers[0], whole.model.layers[0]
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    other = build("tiny-llama", 2, "cpu")  # its second layer's MLP of another layout: refused whole
    other.model.layers[1].mlp.down_proj = nn.Identity()
    try:
        tensor_parallel.shard(other)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "refused": refused,
        "untouched": tuple(other.model.layers[0].self_attn.q_proj.weight.shape),
        "devices": {str(p.device) for p in [*model.parameters(), *model.buffers()]},
        "q_proj": (
            tuple(layer.self_attn.q_proj.weight.shape),
            tuple(whole_layer.self_attn.q_proj.weight.shape),
        ),
        "down_proj": (tuple(layer.mlp.down_proj.weight.shape), tuple(whole_layer.mlp.down_proj.weight.shape)),
        "rotary": torch.equal(model.model.rotary_emb.inv_freq, whole.model.rotary_emb.inv_freq),
        "norm": bool((layer.input_layernorm.weight == 1).all()),
        "embedding": model.model.embed_tokens.weight.clone(),
        "logits": logits,
    }


def _generate_worker(rank: int) -> dict:
    """generate() with transformers' static cache on a model of local shards, eagerly and with its
    forward compiled by the fp8 backend, and LeanDecoder's step compiled by it, beside the whole
    model's greedy tokens."""
    from fp8compile import tensor_parallel
    from fp8compile.bench.presets import build

    whole, model = build("tiny-llama", 2, "cpu"), build("tiny-llama", 2, "cpu")
    ids = torch.randint(0, 1024, (2, 6), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=5, do_sample=False, cache_implementation="static")
    tokens = {"whole": whole.generate(ids, **options)}
    tensor_parallel.shard(model)
    tokens["eager"] = model.generate(ids, **options)
    model.forward = torch.compile(model.forward, backend=fp8compile.backend(), mode="reduce-overhead")
    tokens["fp8"] = model.generate(ids, **options)
    lean = tensor_parallel.shard(build("tiny-llama", 2, "cpu"))
    decoder = fp8compile.LeanDecoder(lean, backend=fp8compile.backend(), mode="reduce-overhead")
    tokens["lean"] = decoder.generate(ids, max_new_tokens=5)
    return tokens


def _scenarios(rank: int, qwen3_moe_path: str | None, bench_dir: str) -> dict:
    """Every scenario of this file on one gloo group: each spawn costs two fresh processes'
    imports, so the scenarios share one. The Llama first, then the Qwen3-MoE, then the odd MLP,
    which releases its bf16 shards (and restores them), then `bench model --tp 2`."""
    results = {"llama": _llama_worker(rank)}
    torch._dynamo.reset()
    results["local"] = _local_worker(rank)
    torch._dynamo.reset()
    results["built"] = _built_shard_worker(rank)
    results["generate"] = _generate_worker(rank)
    torch._dynamo.reset()
    results["qwen3_moe"] = _qwen3_moe_worker(rank, qwen3_moe_path) if qwen3_moe_path else None
    torch._dynamo.reset()
    results["odd"] = _odd_worker(rank)
    torch._dynamo.reset()
    results["bench"] = _bench_worker(bench_dir)
    return results


@pytest.fixture(scope="module")
def scenario_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp")
    return run_ranks(_scenarios, path, _save_qwen3_moe(path / "qwen3_moe"), str(path / "bench"))


@pytest.fixture(scope="module")
def llama_ranks(scenario_ranks):
    return [rank["llama"] for rank in scenario_ranks]


def test_every_sharded_linear_of_a_tp_llama_is_rewritten_on_its_local_shard(llama_ranks):
    for result in llama_ranks:
        counts = {kind: n // len(result["digests"]) for kind, n in result["counts"].items()}
        assert counts["linear"] == 6 + 1  # q, k, v (one GEMM), gate, up (one GEMM), o; lm_head
        assert counts["silu_mul"] == 1  # down_proj, row-sharded, takes the local silu(gate) * up
        # (an "attention" skip may say why the gqa_attention pass left a prefill's attention alone)
        assert not [s for s in result["skips"] if s.kind in ("linear", "silu_mul")]
        shapes = {r.name: (r.k, r.n, r.shard) for r in result["rewrites"]}
        # (K, N) of this rank's part: column-sharded, half of N; row-sharded, half of K.
        assert shapes["model.layers.0.self_attn.q_proj"] == (512, 256, "Shard(dim=0) over 2 ranks of 512x512")
        assert shapes["model.layers.0.self_attn.k_proj"] == (512, 128, "Shard(dim=0) over 2 ranks of 256x512")
        assert shapes["model.layers.0.self_attn.o_proj"] == (256, 512, "Shard(dim=1) over 2 ranks of 512x512")
        assert shapes["model.layers.0.mlp.down_proj"] == (512, 512, "Shard(dim=1) over 2 ranks of 512x1024")
        assert shapes["lm_head"] == (512, 512, "Shard(dim=0) over 2 ranks of 1024x512")
        assert "this rank's shard" in result["text"] and f"rank {result['rank'][0]} of 2" in result["text"]
        # DTensor's all-reduces reach the ATen graph as functional collectives; without CUDA
        # graphs the all_reduce pass leaves them so, and says why
        assert "'s collectives: " in result["text"] and " all_reduce, " in result["text"]
        assert f"all-reduces, graph 0: {NO_CUDA_GRAPHS}" in result["text"]


def test_every_rank_takes_the_same_decisions_and_compiles_the_same_graphs(llama_ranks):
    first, second = llama_ranks
    assert [r["rank"] for r in llama_ranks] == [(0, 2), (1, 2)]
    assert first["rewrites"] == second["rewrites"]
    assert first["skips"] == second["skips"]
    assert first["digests"] == second["digests"] and len(first["digests"]) == 2
    assert torch.equal(first["logits"], second["logits"])  # lm_head's shards gathered: one answer


def test_a_tp_llama_runs_every_m_without_a_recompile_within_the_fp8_bound(llama_ranks):
    # Warm-up: S = 1, then S = 3 (the dynamic graph); S = 17 and 40 (M = 34 and 80, the medium and
    # large sides of the dispatch) reuse it.
    assert llama_ranks[0]["compiled_after"] == [1, 2, 2, 2]
    for result in llama_ranks:
        # Sharding itself moves the bf16 logits by ~2.5e-5 (the row-sharded linears' partial sums
        # are added in bf16 by the all-reduce); FP8 then stays within 1.15x of what the unsharded
        # model's FP8 composition gives (measured 0.90x-0.99x).
        assert result["tp_bf16"] < 1e-4
        for s in SEQ_LENS:
            assert result["diff"][s] <= 1.15 * result["bound"][s], (s, result["diff"], result["bound"])


def test_local_shards_reach_the_graph_as_plain_tensors_with_the_collectives_inside(scenario_ranks):
    """fp8compile.tensor_parallel: no DTensor for AOTAutograd to unwrap or Dynamo to guard at a
    call; o's and down's all-reduces and the lm_head's gather are ops of the graph (each with its
    wait), which Inductor launches and CUDA graphs capture. The all_reduce pass makes the
    all-reduces fp8compile's (two ranks' gloo sums here; the logits within the bound)."""
    ranks = [rank["local"] for rank in scenario_ranks]
    for result in ranks:
        assert result["graphs"] and all(g["dtensors"] == 0 for g in result["graphs"])
        assert all(
            g["collectives"]
            == [
                "_c10d_functional.all_gather_into_tensor",
                "_c10d_functional.all_reduce",
                "_c10d_functional.wait_tensor",
            ]
            for g in result["graphs"]
        )
        assert result["kv_heads"] == 2  # 4 KV heads over 2 ranks
        # the report says so, per rank and graph (on the CPU no graph is a CUDA graph)
        for g in result["digests"]:
            assert (
                f"graph {g}'s collectives: 1 all_gather_into_tensor, 2 {FP8COMPILE_ALL_REDUCE}, "
                "launched at each call" in result["text"]
            )
        assert "on cpu: the group's own collective (symmetric memory serves CUDA tensors" in result["text"]
        # this rank's part, as with DTensor: column-sharded half of N, row-sharded half of K
        shapes = {r.name: (r.k, r.n) for r in result["rewrites"]}
        assert shapes["model.layers.0.self_attn.q_proj"] == (512, 256)
        assert shapes["model.layers.0.self_attn.o_proj"] == (256, 512)
        assert shapes["model.layers.0.mlp.down_proj"] == (512, 512)
        assert shapes["lm_head"] == (512, 512)
        assert not [s for s in result["skips"] if s.kind in ("linear", "silu_mul")]
        assert result["tp_bf16"] < 1e-4  # the partial sums added by the all-reduce, as with DTensor
        for s in SEQ_LENS:
            assert result["diff"][s] <= 1.15 * result["bound"][s], (s, result["diff"], result["bound"])
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])  # the gathered logits: one answer


def test_generate_with_a_static_cache_runs_on_local_shards_eager_and_compiled(scenario_ranks):
    """transformers' StaticCache takes its heads from the first keys it stores: this rank's. The
    greedy tokens are the whole model's (sharding moves the bf16 logits by ~3e-5), compiled too."""
    for rank in scenario_ranks:
        tokens = rank["generate"]
        assert tokens["whole"].shape == (2, 11)
        assert torch.equal(tokens["eager"], tokens["whole"]) and torch.equal(tokens["fp8"], tokens["whole"])
        assert torch.equal(tokens["lean"], tokens["whole"])  # its cache made with this rank's KV heads


def test_bench_model_builds_each_ranks_shard_alone_with_transformers_initialization(scenario_ranks):
    """A model too large for one GPU (Llama-3-70B widths) is never whole on one: the preset is made
    on the meta device, sharded there, and only this rank's part is allocated and initialized."""
    ranks = [rank["built"] for rank in scenario_ranks]
    for result in ranks:
        assert result["devices"] == {"cpu"}  # nothing left on the meta device
        (q, q_whole), (down, down_whole) = result["q_proj"], result["down_proj"]
        assert q == (q_whole[0] // 2, q_whole[1]) and down == (down_whole[0], down_whole[1] // 2)
        assert result["rotary"] and result["norm"]  # buffers and norms as transformers makes them
        assert torch.isfinite(result["logits"]).all()
        assert result["refused"].startswith("layer 1 of LlamaForCausalLM has no mlp.down_proj")
        assert result["untouched"] == q_whole  # nothing sharded before the refusal
    # the replicated weights drawn alike on every rank, so the ranks compute one model
    assert torch.equal(ranks[0]["embedding"], ranks[1]["embedding"])
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])


class _OddMLP(nn.Module):
    """hidden 512, intermediate 640: on 2 ranks, 320 of the intermediate each, which splits a
    128-wide group."""

    def __init__(self):
        super().__init__()
        self.up = GatedMLP(512, 1024)  # shards of 512: whole blocks
        self.odd = GatedMLP(512, 640)

    def forward(self, x):
        return self.odd(self.up(x))


def _odd_worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = _OddMLP().to(torch.bfloat16)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        simulated = calc_diff(fp8_simulated(model)(x), model(x))
    mesh = init_device_mesh("cpu", (WORLD,))
    for mlp in ("up", "odd"):
        plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        parallelize_module(getattr(model, mlp), mesh, plan)
    with torch.no_grad():
        eager = model(x)
        fp8 = fp8compile.backend(release_bf16_weights=True)
        out = torch.compile(model, backend=fp8)(x)
        local = [t for p in model.parameters() for t in shards.inner_tensors(p)]  # a DTensor's shard
        released = [t for t in local if release.is_released(t)]
        lent = calc_diff(model(x), eager)  # the released local shards lent to the eager call
        released_after = all(t.untyped_storage().nbytes() == 0 for t in released)
        fp8compile.restore_bf16_weights()
        restored = calc_diff(model(x), eager)
    return {
        **_report_summary(fp8.report),
        "diff": calc_diff(out, eager),
        "bound": simulated,
        "released": len(released),
        "lent": lent,
        "released_after": released_after,
        "restored": restored,
    }


@pytest.fixture(scope="module")
def odd_ranks(scenario_ranks):
    return [rank["odd"] for rank in scenario_ranks]


def test_a_shard_that_splits_an_activation_group_is_padded_to_whole_groups_on_its_rank(odd_ranks):
    for result in odd_ranks:
        rewritten = {r.name: (r.k, r.n) for r in result["rewrites"]}
        skipped = {s.name: s.reason for s in result["skips"] if s.kind == "linear"}
        # The whole-block MLP: gate and up in one GEMM, down fused with silu * up.
        assert rewritten["up.gate_proj"] == rewritten["up.up_proj"] == (512, 512)
        assert rewritten["up.down_proj"] == (512, 512)
        # The odd one: gate and up column-sharded to N = 320 (a partial last block), each its own
        # GEMM; down row-sharded to K = 320, padded on each rank to whole 1x128 groups (384):
        # zero columns add nothing to the rank's partial sum.
        assert rewritten["odd.gate_proj"] == rewritten["odd.up_proj"] == (512, 320)
        assert rewritten["odd.down_proj"] == (384, 512)
        assert not skipped
        # Within 1.15x of the unsharded FP8 composition, all six linears FP8 (measured 0.92x)
        assert result["diff"] <= 1.15 * result["bound"], (result["diff"], result["bound"])


def test_released_bf16_shards_are_lent_to_an_eager_call_and_freed_after_it(odd_ranks):
    for result in odd_ranks:
        assert result["released"] == 6  # both MLPs' gate, up and down shards
        assert result["lent"] == 0.0 and result["released_after"]
        assert result["restored"] == 0.0


def _qwen3_moe_worker(rank: int, path: str) -> dict:
    """A Qwen3-MoE loaded with transformers' own TP plan (experts sharded within each expert:
    gate_up_proj "packed_colwise", down_proj "rowwise"), against the same checkpoint unsharded,
    compiled with backend="fp8" in one process."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        bf16 = whole(ids).logits
        single = torch.compile(whole, backend=fp8compile.backend())(ids).logits
    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.bfloat16,
        distributed_config=DistributedConfig(tp_plan="auto"),
    ).eval()
    fp8 = fp8compile.backend()
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
    return {
        **_report_summary(fp8.report),
        "diff": calc_diff(logits, bf16),
        "bound": calc_diff(single, bf16),
    }


def _save_qwen3_moe(path) -> str | None:
    """test_moe's Qwen3-MoE at widths whose shards over 2 ranks are whole 128-blocks, saved as a
    checkpoint for transformers' TP plan to load; None without accelerate (the plan loads through it)."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return None
    from transformers import Qwen3MoeForCausalLM

    from tests.test_moe import qwen3_moe_config

    torch.manual_seed(0)
    config = qwen3_moe_config(
        "grouped_mm",
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def test_a_qwen3_moe_sharded_by_transformers_tp_plan_has_its_experts_rewritten_per_shard(scenario_ranks):
    if scenario_ranks[0]["qwen3_moe"] is None:
        pytest.skip("accelerate is not installed: transformers' TP plan loads through it")
    ranks = [rank["qwen3_moe"] for rank in scenario_ranks]
    for result in ranks:
        # One graph on transformers 5.24; on 5.17 its TP hooks break the graph, and the frame of a
        # layer compiled once serves both (names relative to it: "mlp.experts"): so no counts here.
        experts = [r for r in result["rewrites"] if r.kind == "moe"]
        assert experts and all(r.name.endswith("mlp.experts") for r in experts)
        # Each rank holds half of every expert: gate and up 128 rows each, down 128 columns.
        assert all((r.k, r.n) == (512, 256) for r in experts)
        assert all("down_proj: Shard(dim=2) over 2 ranks of 8x512x256" in r.shard for r in experts)
        assert {(r.k, r.n) for r in result["rewrites"] if r.kind == "linear"} == {
            (512, 256),  # q, column-sharded
            (512, 128),  # k, v
            (256, 512),  # o, row-sharded
            (512, 512),  # lm_head, column-sharded (vocab 1024)
        }
        assert all(s.name.endswith("mlp.gate") for s in result["skips"])  # only the routers stay bf16
        # Within 1.15x of the unsharded model compiled with backend="fp8" (measured 0.99x)
        assert result["diff"] <= 1.15 * result["bound"], (result["diff"], result["bound"])
    assert ranks[0]["rewrites"] == ranks[1]["rewrites"] and ranks[0]["digests"] == ranks[1]["digests"]


def _bench_worker(out_dir: str) -> dict:
    """`bench model --tp 2` on this rank of the group the other scenarios ran in (bench_model
    spawns its own ranks only where there is no group): one timed call, one prefill batch, and
    of the fp8 variants the one a TP user runs (their own compile in reduce-overhead; LeanDecoder
    on local shards: _generate_worker);
    test_whole_model's plumbing test covers the others."""
    from pathlib import Path

    from fp8compile.bench.model import bench_model

    rows = bench_model(
        Path(out_dir),
        **TINY_BENCH,
        variants=["bf16", "fp8_ro_own"],
        tp=2,
        repeat=1,
        prefill_batches=[1],
    )
    return {"rows": rows, "written": (Path(out_dir) / "bench_model.json").exists()}


def test_a_model_whose_own_code_does_not_run_on_split_shapes_is_refused_before_any_weight_moves():
    """OLMo-2 normalizes q and k over the whole projection, StableLM reshapes by the heads of its
    config: split by heads, their forward fails deep inside. check() runs the layout on the meta
    device first and refuses them, saying why; Llama, Qwen3 (q and k normalized per head) and
    Gemma-2 pass. A config without the sizes the layout splits is refused by name."""
    from fp8compile import architectures, tensor_parallel

    for arch in ("olmo2", "stablelm"):
        model = architectures.build(arch)
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        with pytest.raises(ValueError, match="sharded over 2 ranks does not run: RuntimeError"):
            tensor_parallel.check(model, 2)
        assert model.model.layers[0].self_attn.q_proj.weight is q_proj  # nothing sharded
    for arch in ("llama", "qwen3", "gemma2"):
        model = architectures.build(arch)
        assert tensor_parallel.check(model, 2) is model.model.layers
    with pytest.raises(ValueError, match="GPT2LMHeadModel's config has no intermediate_size"):
        tensor_parallel.check(architectures.build("gpt2"), 2)


def _every_architecture(rank: int) -> dict:
    """Every causal LM of the installed transformers built small (architectures.build) that runs
    whole on 2 x 16 tokens: sharded over the ranks, ("ran", its logits' calc_diff against the
    whole model's; then compiled by the fp8 backend, without Inductor as the matrix runs, its
    calc_diff, and that of the sharded model's unfused FP8 composition), ("refused", shard()'s
    ValueError) or ("crashed", the error)."""
    from fp8compile import architectures, tensor_parallel
    from fp8compile.passes import all_reduce_norm

    # the fused all-reduce and RMSNorm rewritten wherever it matches, as on GPUs whose symmetric
    # memory serves the sizes (on the CPU the op's fallback runs: the group's sum, the same arithmetic)
    all_reduce_norm.kernel_refuses = lambda site: None
    out = {}
    for arch in architectures.causal_lm_architectures():
        try:  # not built small, or failing whole (the architecture matrix says why): not this test's
            model = architectures.build(arch)
            vocab = model.config.get_text_config(decoder=True).vocab_size
            ids = torch.randint(0, min(vocab, 512), (2, 16), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                whole = model(ids).logits.float()
        except Exception:  # noqa: BLE001
            continue
        try:
            tensor_parallel.shard(model)
        except ValueError as error:
            out[arch] = ("refused", str(error))
            continue
        try:
            torch._dynamo.reset()
            with torch.no_grad():
                sharded = calc_diff(model(ids).logits.float(), whole)
                with architectures.composition(model):
                    bound = calc_diff(model(ids).logits.float(), whole)
                fp8 = fp8compile.backend(inductor=False)
                compiled = torch.compile(model, backend=fp8, mode="reduce-overhead")
                fp8_diff = calc_diff(compiled(ids).logits.float(), whole)
                fused = sum(c.get(FP8COMPILE_ALL_REDUCE_NORM, 0) for c in fp8.report.collectives.values())
                out[arch] = ("ran", sharded, fp8_diff, bound, fused)
        except Exception as error:  # noqa: BLE001
            out[arch] = ("crashed", f"{type(error).__name__}: {error}")
    return out


def test_every_architecture_shards_and_runs_as_the_whole_model_or_is_refused_with_why(tmp_path):
    """tensor_parallel.shard over two ranks on every causal LM of the installed transformers that
    runs whole at the matrix's small sizes: none crashes. Each sharded one gives the whole model's
    logits up to bf16 rounding (the o and down partials summed over the ranks: at most 6.1e-5 of
    26 with transformers 5.24, 2026-11-29, 098ac8f). Compiled by the fp8 backend on its shards in
    reduce-overhead, with the all-reduce, residual add and RMSNorm in one op wherever that form is
    (15 of the 26, two sites a layer), it stays within 1.15x of its own unfused FP8 composition
    (0.98-1.02x of it, measured at 098ac8f without that op and at 33c3a60 with it); every other is
    refused with a ValueError before a weight moves."""
    from transformers import CONFIG_MAPPING

    from fp8compile import architectures

    outcomes = run_ranks(_every_architecture, tmp_path)[0]
    crashed = {arch: outcome[1] for arch, outcome in outcomes.items() if outcome[0] == "crashed"}
    assert not crashed
    ran = {arch: outcome[1:] for arch, outcome in outcomes.items() if outcome[0] == "ran"}
    assert all(sharded < 5e-4 for sharded, _, _, _ in ran.values()), ran
    assert all(0 < fp8 <= 1.15 * bound for _, fp8, bound, _ in ran.values()), ran
    # the layouts the sharding is for run, not refused; their o's and down's all-reduces (two a
    # layer) fused with the RMSNorm after them (Gemma's 1 + weight norm is another form, left)
    assert {"llama", "qwen2", "mistral", "gemma2", "qwen3"} & set(CONFIG_MAPPING) <= set(ran)
    layers = {
        arch: architectures.build(arch).config.num_hidden_layers for arch in ("llama", "qwen2", "qwen3")
    }
    assert all(ran[arch][3] == 2 * n for arch, n in layers.items()), ran
    assert ran["gemma2"][3] == 0
    if "olmo2" in outcomes:
        assert outcomes["olmo2"][0] == "refused" and "does not run" in outcomes["olmo2"][1]


def test_a_sharded_model_says_its_all_reduces_one_for_each_row_sharded_linear(one_rank_group):
    """What bench model's limit counts for a sharded step (limits.all_reduce_ms): o and down of
    every layer, each summing hidden features; the lm_head's gather is not an all-reduce."""
    from fp8compile import tensor_parallel

    model = small_llama(vocab=512, hidden=256, intermediate=512, layers=3)
    assert tensor_parallel.all_reduces(model) == []
    tensor_parallel.shard(model)
    assert tensor_parallel.all_reduces(model) == [(one_rank_group, 256)] * 6


def test_bench_models_limit_counts_every_all_reduce_of_a_step_and_goes_on_where_timing_fails(
    one_rank_group, caplog
):
    """limits.all_reduce_ms: the six all-reduces of a 3-layer step, each at its kind's time alone
    at the step's batch; a timing that fails leaves the limit without them, said, not the bench."""
    from fp8compile import tensor_parallel
    from fp8compile.bench.limits import all_reduce_ms

    model = tensor_parallel.shard(small_llama(vocab=512, hidden=256, intermediate=512, layers=3))
    timed = []

    def timer(batch, kind, dtype, device):  # us: 7.5 a call at batch 1, 10 at batch 16
        timed.append((batch, kind, dtype))
        return 7.5 if batch == 1 else 10.0

    gpu = torch.device("cuda", 0)  # the timer stands in for the GPU's timing: nothing runs there
    assert all_reduce_ms(model, [1, 16], gpu, timer) == pytest.approx({1: 6 * 7.5e-3, 16: 6 * 10e-3})
    bf16 = torch.bfloat16  # the model's dtype: what its all-reduces sum
    assert timed == [(1, (one_rank_group, 256), bf16), (16, (one_rank_group, 256), bf16)]
    assert all_reduce_ms(model, [1, 16], torch.device("cpu"), timer) == {}  # the limit's rate is the GPU's

    def fails(*args):
        raise RuntimeError("no symmetric memory here")

    assert all_reduce_ms(model, [1], gpu, fails) == {}
    assert "the all-reduces were not timed (RuntimeError: no symmetric memory here)" in caplog.text


def test_bench_model_tp_plumbing_shards_decodes_and_writes_rank_zeros_rows(scenario_ranks):
    from fp8compile.bench.table import model_table

    leader, other = (rank["bench"] for rank in scenario_ranks)
    assert leader["written"]  # rank 0 writes; both ranks ran every variant in step
    rows = leader["rows"]
    decode = {r["variant"]: r for r in rows if r["kind"] == "decode"}
    assert set(decode) == {"bf16", "fp8_ro_own"} and all(r["tp"] == 2 for r in rows)
    assert all(r["recompiles"] == 0 and r["tokens_per_s"] > 0 for r in decode.values())
    accuracy = {r["variant"]: r["calc_diff"] for r in rows if r["kind"] == "accuracy"}
    # against the sharded model's bf16 eager; bounded by the same sharded model's unfused
    # composition, each rank's linears on the reference block-FP8 linear over its own shard (measured
    # 1.01x)
    assert accuracy["bf16"] == 0 and 0 < accuracy["fp8_ro_own"] <= 1.15 * accuracy["fp8_unfused_eager"]
    assert {r["tp"] for r in rows if r["variant"] == "fp8_unfused_eager"} == {2}
    # what each graph's collectives are and run on, as the report says them (printed, and kept)
    (fp8_accuracy,) = (r for r in rows if r["variant"] == "fp8_ro_own" and r["kind"] == "accuracy")
    assert any("collectives: " in line and "all_reduce" in line for line in fp8_accuracy["collectives"])
    assert "x 2 (tensor parallel)" in model_table(rows)
    assert [(r["variant"], r["kind"]) for r in other["rows"]] == [(r["variant"], r["kind"]) for r in rows]

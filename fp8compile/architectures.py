"""The architecture matrix: causal LMs of the installed transformers, built small with random
weights and compiled with backend="fp8" on the CPU (`python -m fp8compile models`), or on the GPU
with its kernels (`--device cuda`: what the CPU's reference kernels cannot show, such as a
kernel that is wrong at a small model's shapes).

For each architecture: what was rewritten (counts per kind), what stayed bf16 and why, and the
logits' calc_diff against eager bf16 beside that of the same model's own unfused block-FP8
composition (`composition`): every bf16 nn.Linear (or GPT-2-style Conv1D) that the linear pass
would take (K a multiple of 128, N at least 128: a router's N is not) runs the reference
block-FP8 linear, every expert GEMM that transformers' experts integration makes (its
`_grouped_mm`) runs the reference block-FP8 linear per expert, and so does every F.linear on one
expert of experts stacked in one parameter (JetMoE's w[i]; LongCat-Flash's too, whose Python loop
over the experts hit runs outside any compiled graph and so stays bf16 in the compiled model:
its bound is a little looser for it); activations quantized 1x128 per token, weights 128x128 per
expert. That is the FP8 error of the model's GEMMs taken one by one; the compiled model may
differ from it only where a fused op rounds once where eager rounds twice.

The bound is on the typical token: the median over tokens of each token's logits calc_diff, no
more than 1.15x the composition's. In these small random-weight MoE models a few tokens' top-k
choices flip under any FP8 rounding, and those tokens dominate the pooled calc_diff: on
DeepSeek-V3, seeds 0-2, the compiled model's pooled calc_diff was 1.18x, 1.00x and 0.91x the
composition's while the medians agreed to 0.3% (4.90e-3 against 4.89e-3 on seed 0, its worst
five tokens 0.14-0.18 on both sides). The pooled calc_diff is reported beside it, and more than
1.5x the composition's fails too.

A config is built small by setting, where the architecture's config has them, the sizes below
(widths multiples of 128, 2 layers, 8 experts, top-2); an architecture that cannot be built or
run that way in eager is listed as such, since that is no fault of the backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from .numerics import BLOCK, calc_diff
from .passes import dtypes

# Sizes set on a config where it has the attribute (its constructor sees them, so values it
# derives from them follow).
SMALL = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    ffn_hidden_size=512,
    num_hidden_layers=2,
    num_layers=2,
    n_layer=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    # the same sizes under other names (GPT-2, OPT, BART-style decoders)
    n_embd=256,
    n_head=4,
    n_inner=512,
    n_positions=256,
    d_model=256,
    ffn_dim=512,
    word_embed_proj_dim=256,
    decoder_layers=2,
    decoder_attention_heads=4,
    decoder_ffn_dim=512,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=512,
    # MoE
    num_experts=8,
    num_local_experts=8,
    n_routed_experts=8,
    moe_num_experts=8,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    # MLA
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
    # sliding windows shorter than the prompt, so that they matter
    sliding_window=16,
)
BATCH, TOKENS = 4, 64  # 256 tokens: a few flipped top-k choices weigh less in calc_diff
BOUND_FACTOR = 1.15  # the typical token's: no worse than 1.15x the unfused composition's
MAX_PARAMS = 100_000_000  # a small model has a few million; past this its sizes were not reached
POOLED_FACTOR = 1.5  # the pooled calc_diff's, loose for the flipped top-k choices (module docstring)


@dataclasses.dataclass
class Row:
    """One architecture's line of the matrix."""

    arch: str
    status: str  # "rewritten", "over bound", "nothing rewritten", "not built small", "failed"
    counts: dict = dataclasses.field(default_factory=dict)
    experts: str = ""  # "MoE" where the model has experts blocks
    calc_diff: float | None = None  # pooled over every token's logits
    composition: float | None = None
    median: float | None = None  # the median token's
    median_composition: float | None = None
    kept: dict = dataclasses.field(default_factory=dict)  # reason -> how many candidates
    note: str = ""
    seconds: float = 0.0
    dtype: str = "bfloat16"  # the model's
    decode: list = dataclasses.field(default_factory=list)  # generate_check.Decode per mode, as dicts
    lean: str = ""  # LeanDecoder on the fp8 backend (--lean): "ran", "refused: ..." or the error

    @property
    def within_bound(self) -> bool:
        return (
            self.median <= BOUND_FACTOR * self.median_composition
            and self.calc_diff <= POOLED_FACTOR * self.composition
        )


def causal_lm_architectures() -> list[str]:
    """The model types transformers maps to a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def small_config(arch: str):
    """The architecture's config with SMALL's sizes where it has those attributes, in its nested
    text (and other) sub-configs too: a multimodal model's language model is what runs."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[arch]
    return config_class(**_small_sizes(config_class()))


def _small_sizes(default) -> dict:
    """SMALL's sizes for a config of these defaults, and for each of its sub-configs (as a dict of
    its fields, less the per-layer lists sized for its default depth, which follow the new one)."""
    sizes = {key: value for key, value in SMALL.items() if hasattr(default, key)}
    for name, token in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if getattr(default, name, None) is not None:
            sizes[name] = token  # the default ones may lie past the small vocabulary
    if hasattr(default, "kv_lora_rank"):  # MLA: every head has its own K and V
        sizes["num_key_value_heads"] = SMALL["num_attention_heads"]
    # MoE models whose dense first layers are a list, not first_k_dense_replace, and leave the two
    # small layers without experts (Beam's three dense layers, Flint's layers 0 and 1): one dense
    # layer then experts, as first_k_dense_replace=1 gives
    types = getattr(default, "mlp_layer_types", None) or ()
    if "sparse" in types and "sparse" not in types[:2]:
        sizes["mlp_layer_types"] = ["dense", "sparse"]
    if {0, 1} <= set(getattr(default, "mlp_only_layers", None) or ()):
        sizes["mlp_only_layers"] = [0]
    for key, sub in vars(default).items():
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            depth = getattr(sub, "num_hidden_layers", None)
            fields = {
                name: value
                for name, value in sub.to_dict().items()
                if not (isinstance(value, list) and depth and len(value) == depth)
            }
            sizes[key] = {**fields, **_small_sizes(sub)}
    return sizes


def build(arch: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The small model in `dtype` (bfloat16 or float16), eval mode, weights N(0, 0.02)
    (transformers' own init, reseeded). Built on the meta device first: a config whose sizes
    SMALL does not reach (other names) is refused with its parameter count instead of
    exhausting the machine's memory."""
    from transformers import AutoModelForCausalLM

    config = small_config(arch)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if params > MAX_PARAMS:
        raise ValueError(
            f"{params / 1e6:.0f}M parameters at the small sizes (at most {MAX_PARAMS / 1e6:.0f}M): "
            "its sizes go by names the matrix does not set"
        )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model = model.to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    return model


def _linear_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The (N, K) weight of a linear the linear pass would take (K and N at least 128, bf16 or fp16; a K
    of part of a group is padded, quant_reference.quant_weight_block): an nn.Linear's, or a GPT-2-style
    Conv1D's (weight (K, N), x @ w + b), else None."""
    if isinstance(module, torch.nn.Linear):
        w = module.weight
    elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        w = module.weight.t()
    else:
        return None
    n, k = w.shape
    return w.detach() if w.dtype in dtypes.SERVED and k >= BLOCK and n >= BLOCK else None


def _block_fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' _grouped_mm (x (S, K) sorted by expert, w (E, K, N), offs the experts' ends)
    in unfused block FP8: each expert's rows through the reference block-FP8 linear."""
    from .ops.linear import reference as linear_reference
    from .ops.quant import reference as quant_reference

    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            w_fp8, w_scale = quant_reference.quant_weight_block(w[e].t())
            out[start:end] = linear_reference.linear_block(x[start:end], w_fp8, w_scale)
        start = end
    return out


@contextlib.contextmanager
def composition(model: torch.nn.Module, recipe: str = "block"):
    """Within the block, `model` runs its unfused block-FP8 composition (module docstring); with
    recipe "rowwise" or "tensor", its linears run that recipe (dynamic scales) and the experts
    stay block-FP8, as the compiled model's do not: bound those models by their dense peers."""
    from .ops.linear import reference as linear_reference
    from .ops.quant import reference as quant_reference
    from .ops.linear import reference_scaled

    def fp8_linear(weight, bias=None):
        if recipe == "block":
            w_fp8, w_scale = quant_reference.quant_weight_block(weight)
            return lambda x: linear_reference.linear_block(x, w_fp8, w_scale, bias)
        w_fp8, w_scale = reference_scaled.quant_weight_scaled(weight, recipe)
        return lambda x: reference_scaled.linear_scaled(x, w_fp8, w_scale, bias, recipe)

    patched = []
    for module in model.modules():
        weight = _linear_weight(module)
        if weight is not None:
            module.forward = fp8_linear(weight, module.bias)
            patched.append(module)
    plain_linear = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        # One expert's linear, F.linear(x, w[i]) over experts stacked in one parameter (JetMoE's),
        # as the linear pass takes it (selected_linear).
        base = weight._base
        n, k = weight.shape if weight.dim() == 2 else (0, 0)
        if base is not None and base.dim() == 3 and weight.dtype in dtypes.SERVED and min(n, k) >= BLOCK:
            return fp8_linear(weight.detach(), bias)(x)
        return plain_linear(x, weight, bias)

    torch.nn.functional.linear = linear
    plain_bmm = torch.bmm

    def bmm(a, b, **kwargs):
        # Dense experts: a bmm over a whole stacked expert parameter (or its transpose), each
        # expert's rows through the reference block-FP8 linear, as the moe pass runs Llama 4's top-k
        # slots (a token's rows off its top-k are zeros either way) and splits other such bmm's
        # into one FP8 linear per expert (moe_dense.py).
        param = b if isinstance(b, torch.nn.Parameter) else b._base
        if isinstance(param, torch.nn.Parameter) and b.dim() == 3 and b.dtype in dtypes.SERVED and not kwargs:
            experts = [quant_reference.quant_weight_block(b[e].detach().t()) for e in range(b.shape[0])]
            return torch.stack([linear_reference.linear_block(a[e], *w) for e, w in enumerate(experts)])
        return plain_bmm(a, b, **kwargs)

    torch.bmm = bmm
    try:
        from transformers.integrations import moe as experts_integration
    except ImportError:
        experts_integration = None
    grouped = getattr(experts_integration, "_grouped_mm", None)
    if grouped is not None:
        experts_integration._grouped_mm = _block_fp8_grouped_mm
    try:
        yield
    finally:
        torch.nn.functional.linear = plain_linear
        torch.bmm = plain_bmm
        for module in patched:
            del module.forward
        if grouped is not None:
            experts_integration._grouped_mm = grouped


def _logits(out) -> torch.Tensor:
    return (out.logits if hasattr(out, "logits") else out[0]).float()


def median_token_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """The median over tokens of calc_diff between each token's logits (last dimension)."""
    x, y = x.double().flatten(0, -2), y.double().flatten(0, -2)
    per_token = 1 - 2 * (x * y).sum(-1) / (x * x + y * y).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    return float(per_token.median())


def run(
    arch: str,
    seed: int = 0,
    device: str = "cpu",
    modes: tuple[str, ...] = (),
    dtype: torch.dtype = torch.bfloat16,
    null: bool = False,
    lean: bool = False,
) -> Row:
    """One architecture through the matrix (module docstring), its model in `dtype` (float16: the
    bound is its own float16 composition's). On "cuda" the compiled model runs the GPU kernels the
    registry picks, and eager and the composition run there too.
    modes: also generate() in these compile modes, bf16 Inductor beside fp8 (generate_check;
    timed on a GPU): an exception of fp8's side there makes the row "failed". null: time bf16
    Inductor on both sides instead (generate_check.decode), the ratio's noise floor. lean: also
    decode through fp8compile.LeanDecoder on the fp8 backend (_lean)."""
    import fp8compile

    begin = time.perf_counter()
    row = Row(arch, "failed", dtype=dtypes.name(dtype))
    try:
        model = build(arch, seed, dtype).to(device)
        torch.manual_seed(seed + 1)
        ids = torch.randint(0, model.config.vocab_size, (BATCH, TOKENS), device=device)
        with torch.no_grad():
            eager = _logits(model(ids))
            with composition(model):
                simulated = _logits(model(ids))
    except Exception as e:  # noqa: BLE001  the architecture itself, in eager: not the backend's
        row.status, row.note = "not built small", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        row.seconds = time.perf_counter() - begin
        return row
    if any(type(m).__name__.endswith("Experts") for m in model.modules()):
        row.experts = "MoE"
    fp8 = fp8compile.backend()
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            logits = _logits(torch.compile(model, backend=fp8)(ids))
    except Exception as e:  # noqa: BLE001  recorded in the matrix: a crash is what it must show
        row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        row.seconds = time.perf_counter() - begin
        return row
    finally:
        torch._dynamo.reset()
    row.counts = {kind: n for kind, n in fp8.report.counts().items() if n}
    for skip in fp8.report.skips:
        reason = skip.reason.split(":")[0] if skip.kind == "graph" else skip.reason
        key = f"{skip.kind}: {reason[:120]}"
        row.kept[key] = row.kept.get(key, 0) + 1
    row.calc_diff, row.composition = calc_diff(logits, eager), calc_diff(simulated, eager)
    row.median, row.median_composition = median_token_diff(logits, eager), median_token_diff(simulated, eager)
    if not row.counts:
        row.status = "nothing rewritten"
    elif row.within_bound:
        row.status = "rewritten"
    else:
        row.status = "over bound"
    _decode(row, model, device, modes, null)
    if lean:
        _lean(row, model, device)
    row.seconds = time.perf_counter() - begin
    return row


def _decode(row: Row, model, device: str, modes: tuple[str, ...], null: bool = False) -> None:
    from . import generate_check

    for mode in modes:
        result = generate_check.decode(model, mode, device, timed=device != "cpu", null=null)
        row.decode.append(dataclasses.asdict(result))
        if result.error.startswith("fp8"):
            row.status, row.note = "failed", f"generate() in {mode}: {result.error}"


LEAN_PROMPT, LEAN_NEW_TOKENS = 12, 6


def _lean(row: Row, model, device: str) -> None:
    """LeanDecoder on the fp8 backend (reduce-overhead on a GPU, no compile mode on the CPU):
    two sequences, one left-padded, greedy, then drawn with temperature and top-p. A model it
    refuses (no static cache) is a row's note, not a failure; an exception, or tokens of the
    wrong shape or past the lm_head's outputs, fails the row."""
    import fp8compile

    from .lean_decode import LeanDecoder

    try:
        decoder = LeanDecoder(
            model, backend=fp8compile.backend(), mode="reduce-overhead" if device != "cpu" else None
        )
    except ValueError as refused:  # a model without a static cache: LeanDecoder says so
        row.lean = f"refused: {str(refused).splitlines()[0][:160]}"
        return
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, LEAN_PROMPT), device=device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second sequence left-padded
    try:
        head = getattr(model.get_output_embeddings(), "weight", None)  # its rows: the logits' width
        vocab = max(model.config.vocab_size, head.shape[0] if head is not None else 0)
        torch._dynamo.reset()
        with torch.no_grad():
            for options in ({}, dict(do_sample=True, temperature=0.7, top_p=0.9)):
                tokens = decoder.generate(ids, LEAN_NEW_TOKENS, attention_mask=mask, **options)
                if (
                    tokens.shape != (2, LEAN_PROMPT + LEAN_NEW_TOKENS)
                    or not ((tokens >= 0) & (tokens < vocab)).all()
                ):
                    raise ValueError(
                        f"tokens of shape {tuple(tokens.shape)}, or past the lm_head's {vocab} outputs"
                    )
        row.lean = "ran"
    except Exception as error:  # noqa: BLE001  a row of the matrix: a crash is what it must show
        row.lean = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        row.status, row.note = "failed", f"LeanDecoder: {row.lean}"
    finally:
        torch._dynamo.reset()


def run_isolated(
    arch: str,
    timeout: float = 600,
    device: str = "cpu",
    modes: tuple[str, ...] = (),
    dtype: torch.dtype = torch.bfloat16,
    null: bool = False,
    lean: bool = False,
) -> Row:
    """run(arch) in a fresh Python process: an architecture that exhausts memory, hangs or kills
    its process becomes a "failed" row instead of ending the matrix (and compiled graphs do not
    pile up over hundreds of models in one process)."""
    import json
    import subprocess
    import sys

    begin = time.perf_counter()
    command = [sys.executable, "-m", "fp8compile", "models", "--in-process", "--device", device, arch]
    command += ["--dtype", dtypes.name(dtype)]
    command += [f"--generate={mode}" for mode in modes] + ["--null"] * null + ["--lean"] * lean
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Row(
            arch,
            "failed",
            note=f"no result within {timeout:.0f} s",
            seconds=time.perf_counter() - begin,
            dtype=dtypes.name(dtype),
        )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return Row(
            arch,
            "failed",
            note=f"process exit {done.returncode}: {last}",
            seconds=time.perf_counter() - begin,
            dtype=dtypes.name(dtype),
        )
    return Row(**json.loads(lines[-1]))


def table(rows: list[Row], modes: tuple[str, ...] = (), lean: bool | None = None) -> str:
    """The matrix as a Markdown table; a generate() column per mode (those of the rows' by
    default), and a LeanDecoder one with lean (by default where a row ran it)."""
    modes = list(modes) or list(dict.fromkeys(d["mode"] for r in rows for d in r.decode))
    lean = any(r.lean for r in rows) if lean is None else lean
    lines = [
        "| architecture | status | rewritten | median token calc_diff, x composition | pooled, x composition "
        + "".join(
            f"| generate(), {mode}: fp8 / bf16 Inductor tokens/s, recompiles, CUDA graphs " for mode in modes
        )
        + "| LeanDecoder, fp8 " * lean
        + "| kept bf16 |",
        "|---|---|---|---|---|---|" + "---|" * (len(modes) + lean),
    ]
    for r in rows:
        counts = ", ".join(f"{kind} {n}" for kind, n in r.counts.items()) or "-"
        median = pooled = "-"
        if r.calc_diff is not None:
            median = f"{r.median:.2e}, {r.median / max(r.median_composition, 1e-30):.2f}x"
            pooled = f"{r.calc_diff:.2e}, {r.calc_diff / max(r.composition, 1e-30):.2f}x"
        kept = "; ".join(f"{n} x {reason}" for reason, n in r.kept.items()) or r.note or "-"
        arch = f"{r.arch} ({r.experts})" if r.experts else r.arch
        decode = "".join(f"| {_decode_cell(r, mode)} " for mode in modes)
        decode += f"| {(r.lean or '-').replace('|', '/')} " * lean
        kept = kept.replace("|", "/")
        lines.append(f"| {arch} | {r.status} | {counts} | {median} | {pooled} {decode}| {kept} |")
    return "\n".join(lines)


def _decode_cell(row: Row, mode: str) -> str:
    found = [d for d in row.decode if d["mode"] == mode]
    if not found:
        return "-"
    d = found[0]
    if d["error"]:
        return d["error"].replace("|", "/")
    bf16, fp8 = d["bf16_tokens_per_s"], d["fp8_tokens_per_s"]
    speed = f"{fp8:.0f} / {bf16:.0f} = {fp8 / bf16:.2f}x" if bf16 and fp8 else "ran"
    if d.get("null"):
        return f"null (bf16 Inductor on both sides): {speed}, {d['recompiles']}"
    return f"{speed}, {d['recompiles']}, {d['cuda_graphs'] or '-'}"

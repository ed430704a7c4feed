"""What `bench model` compares: each variant a backend and a compile mode (bf16 eager, bf16
Inductor, fp8 in both modes, rowwise, torchao, the user's own compile), the generic
fp8[_ro]+KEY=VALUE form for an option's A/B, and +inductor.KEY=VALUE on any variant Inductor
compiles, for an A/B of Inductor's own config on both sides (bf16_inductor_ro_lean and
fp8_ro_lean +inductor.combo_kernels=true: Inductor's horizontal fusion of a layer's small
kernels)."""

from __future__ import annotations

import dataclasses

import fp8compile

from ..config import parse_option


# bf16_gqa(_ro): bf16 Inductor plus our gqa_attention pass alone (every linear left bf16), the
# anchor that tells FP8's share of a speedup from the attention rewrite's. fp8_rowwise(_ro): the
# rowwise recipe whatever --recipe says, so that one run puts it beside the block recipe's
# fp8(_ro) on the same host. An A/B of one option is an fp8 variant with +KEY=VALUE
# (split_variant): fp8+inductor_launch=false (the decode kernel behind our op),
# fp8+inline_conds=true, fp8_ro+split_kv=false (decode attention on sdpa's kernel),
# fp8_ro+fusions=moe,gate_up,qkv,silu_mul (without gqa_attention). The FP8-checkpoint variants
# run the model saved as a block-FP8 checkpoint and loaded back by transformers
# (fp8_checkpoint.py): transformers_fp8 is transformers' own FP8 forward in eager mode,
# transformers_fp8_inductor[_ro] the same compiled by Inductor (in reduce-overhead), fp8[_ro]_ckpt
# fp8compile on it. generate() runs the prompt eagerly, through transformers' own FP8 kernels, which
# it loads from the Hub; on a machine offline bench model points them at the installed deep_gemm
# wheel (fp8_checkpoint.transformers_on_installed_deep_gemm). Where neither loads,
# fp8[_ro]_own_ckpt still runs, the prompt through fp8compile's graphs too.
VARIANTS = (
    "bf16",
    "bf16_inductor",
    "bf16_inductor_ro",
    "bf16_gqa",
    "bf16_gqa_ro",
    "fp8",
    "fp8_ro",
    "bf16_inductor_own",
    "fp8_own",
    "bf16_inductor_ro_own",
    "fp8_ro_own",
    "bf16_inductor_ro_lean",
    "fp8_ro_lean",
    "fp8_ro_release",
    "fp8_rowwise",
    "fp8_rowwise_ro",
    "transformers_fp8",
    "transformers_fp8_inductor",
    "transformers_fp8_inductor_ro",
    "fp8_ckpt",
    "fp8_ro_ckpt",
    "fp8_own_ckpt",
    "fp8_ro_own_ckpt",
    "torchao_rowwise_ro",
)


@dataclasses.dataclass
class Variant:
    name: str
    backend: object  # None = eager
    mode: str | None = None
    own: bool = False  # decode through the user's own torch.compile of model.forward, not a CompileConfig
    lean: bool = False  # decode through LeanDecoder (lean_decode.py), not generate()
    checkpoint: bool = False  # the model saved as a block-FP8 checkpoint and loaded back (fp8_checkpoint.py)
    # torch.compile's dynamic; False when sharded (tp.py: DTensor under automatic dynamic shapes fails)
    dynamic: bool | None = None
    # torch._inductor.config entries this variant compiles under (+inductor.KEY=VALUE)
    inductor: dict = dataclasses.field(default_factory=dict)

    def compile_config(self, device):
        from transformers.generation.configuration_utils import CompileConfig

        if self.backend is None or self.own or self.lean:
            return None
        config = CompileConfig(backend=self.backend, mode=self.mode or "default", dynamic=self.dynamic)
        config._compile_all_devices = (
            device.type != "cuda"
        )  # transformers compiles generate() on GPUs only otherwise
        return config


INDUCTOR = "inductor."


def split_variant(name: str) -> tuple[str, dict]:
    """ "fp8_ro+large_m=1536+autotune=true" -> ("fp8_ro", {"large_m": 1536, "autotune": True}):
    a named variant and the Fp8Config options it runs with on top of its own (an A/B of an
    option in one run, on one host); +inductor.KEY=VALUE parts are inductor_options'. Raises
    ValueError on an unknown variant or option."""
    base, *options = (part for part in name.split("+") if not part.startswith(INDUCTOR))
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {base!r}; valid: {', '.join(VARIANTS)}")
    if options and not base.startswith("fp8"):
        raise ValueError(
            f"{name!r}: +KEY=VALUE options set fp8compile's config; {base!r} is not an fp8 variant"
        )
    return base, dict(parse_option(option) for option in options)


def inductor_options(name: str) -> dict:
    """ "bf16_inductor_ro_lean+inductor.combo_kernels=true" -> {"combo_kernels": True}: the
    torch._inductor.config entries a variant compiles under, each typed as the entry's default
    is (true/false, an integer, a number, text). Raises ValueError on an entry Inductor lacks."""
    import torch._inductor.config as config

    found = {}
    for part in name.split("+")[1:]:
        if not part.startswith(INDUCTOR):
            continue
        key, sep, text = part.removeprefix(INDUCTOR).partition("=")
        if not sep or not hasattr(config, key):
            raise ValueError(f"{part!r}: not inductor.KEY=VALUE with KEY an entry of torch._inductor.config")
        default = getattr(config, key)
        if isinstance(default, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError(f"{part!r}: {key} takes true or false")
            found[key] = text.lower() == "true"
        elif isinstance(default, (int, float)):
            found[key] = type(default)(text)
        else:
            found[key] = text
    return found


def composition_recipes(names, recipe: str) -> list[str]:
    """The recipes whose unfused composition bounds these variants' calc_diff: `recipe` (the
    run's --recipe), then any other an fp8 variant runs (fp8_rowwise*, +recipe=...)."""
    found = [recipe]
    for name in names:
        base, options = split_variant(name)
        if base.startswith("fp8"):
            found.append(options.get("recipe") or ("rowwise" if base.startswith("fp8_rowwise") else recipe))
    return list(dict.fromkeys(found))


def is_checkpoint_variant(name: str) -> bool:
    """Whether the variant of this name runs the model's FP8 checkpoint (make_variant's
    Variant.checkpoint, said without making the variant)."""
    base = name.split("+")[0]
    return base.endswith("_ckpt") or base.startswith("transformers_fp8")


def make_variant(name: str, recipe: str = "block"):
    """The Variant for a name (a named variant, with +KEY=VALUE options if an fp8 one), or None
    where it cannot run here (with the reason printed); the fp8 variants in `recipe`."""
    inductor = inductor_options(name)
    if inductor:
        variant = make_variant("+".join(p for p in name.split("+") if not p.startswith(INDUCTOR)), recipe)
        if variant is None:
            return None
        if variant.backend is None:
            raise ValueError(
                f"{name!r}: +inductor.KEY=VALUE sets Inductor's config; this variant runs eagerly"
            )
        return dataclasses.replace(variant, name=name, inductor=inductor)
    base, options = split_variant(name)
    if options:
        variant = make_variant(base, recipe)
        if variant is None:
            return None
        config = variant.backend.config.replace(**options)
        return dataclasses.replace(variant, name=name, backend=fp8compile.backend(config))
    mode = "reduce-overhead" if "ro" in name.split("_") else None
    own = name.endswith(("_own", "_release"))
    if name.endswith("_lean"):
        return dataclasses.replace(make_variant(name.removesuffix("_lean"), recipe), name=name, lean=True)
    if name.endswith("_ckpt"):
        return dataclasses.replace(
            make_variant(name.removesuffix("_ckpt"), recipe), name=name, checkpoint=True
        )
    if name.startswith("transformers_fp8"):
        return Variant(name, "inductor" if "inductor" in name else None, mode, checkpoint=True)
    if name == "bf16":
        return Variant(name, None)
    if name.startswith("bf16_inductor"):
        return Variant(name, "inductor", mode, own)
    if name.startswith("bf16_gqa"):
        return Variant(name, fp8compile.backend(fusions=("gqa_attention",), skip=("*",)), mode)
    if name.startswith("fp8_rowwise"):
        return Variant(name, fp8compile.backend(recipe="rowwise"), mode)
    if name.startswith("fp8"):
        release = name.endswith("_release")
        return Variant(name, fp8compile.backend(release_bf16_weights=release, recipe=recipe), mode, own)
    if name.startswith("torchao"):
        try:
            import torchao  # noqa: F401
        except ImportError:
            print(f"{name}: torchao is not importable, skipped")
            return None
        return Variant(name, "inductor", mode)
    raise ValueError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}")


def torchao_rowwise(model) -> None:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))

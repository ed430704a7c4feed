"""`bench model`'s rows as a table (ratios against the anchors) and a plot."""

from __future__ import annotations

from pathlib import Path

from .output import pyplot


def model_table(rows: list[dict]) -> str:
    """Per model: decode tokens/s per batch, prefill tokens/s, first call, peak memory, accuracy,
    recompiles; then fp8 over bf16 Inductor in the same mode."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        batches = sorted({r["batch"] for r in mine if r["kind"] == "decode"})
        prefills = sorted({r["batch"] for r in mine if r["kind"] == "prefill"}) or [1]
        prefill_names = ["prefill" if b == 1 else f"{b}x prefill" for b in prefills]
        variants = list(dict.fromkeys(r["variant"] for r in mine))
        get = {(r["variant"], r["kind"], r.get("batch")): r for r in mine}
        lines += [
            f"\n{model}, {mine[0]['layers']} layers, {mine[0]['device']}"
            + (f" x {mine[0]['tp']} (tensor parallel)" if mine[0].get("tp", 1) > 1 else "")
            + (f", {mine[0]['dtype']}" if mine[0].get("dtype", "bfloat16") != "bfloat16" else "")
            + ": decode tokens/s (ms/step), "
            f"prefill tokens/s, logits calc_diff vs {mine[0].get('dtype', 'bfloat16')} eager",
            f"{'variant':<20}"
            + "".join(f"{'B=' + str(b):>18}" for b in batches)
            + "".join(f"{name:>11}" for name in prefill_names)
            + f"{'1st call s':>11}{'peak GB':>9}{'warm GB':>9}"
            + f"{'calc_diff':>10}{'recompiles':>11}",
        ]
        for v in variants:
            cells = ""
            for b in batches:
                r = get.get((v, "decode", b))
                cells += f"{r['tokens_per_s']:>9.1f} ({r['ms_per_step']:>5.2f})" if r else f"{'-':>18}"
            acc, mem = get.get((v, "accuracy", None)), get.get((v, "memory", None))
            first = max(
                (r["first_call_s"] for r in mine if r["variant"] == v and "first_call_s" in r), default=None
            )
            recompiles = sum(r.get("recompiles", 0) for r in mine if r["variant"] == v)
            for b in prefills:
                pre = get.get((v, "prefill", b))
                cells += f"{pre['tokens_per_s']:>11.0f}" if pre else f"{'-':>11}"
            cells += f"{first:>11.1f}" if first is not None else f"{'-':>11}"
            cells += (
                f"{mem['peak_gb']:>9.1f}"
                + (f"{mem['warm_peak_gb']:>9.1f}" if mem.get("warm_peak_gb") else f"{'-':>9}")
                if mem
                else f"{'-':>9}{'-':>9}"
            )
            cells += f"{acc['calc_diff']:>10.2e}" if acc else f"{'-':>10}"
            lines.append(f"{v:<20}{cells}{recompiles:>11}")
        for fp8, bf16 in (
            ("fp8", "bf16_inductor"),
            ("fp8_ro", "bf16_inductor_ro"),
            ("fp8_own", "bf16_inductor_own"),
            ("fp8_ro_own", "bf16_inductor_ro_own"),
            ("fp8_ro_release", "bf16_inductor_ro_own"),
            ("fp8_ro_lean", "bf16_inductor_ro_lean"),
            ("fp8_ro_lean", "fp8_ro"),
            ("bf16_inductor_ro_lean", "bf16_inductor_ro"),
            ("fp8_rowwise", "bf16_inductor"),
            ("fp8_rowwise_ro", "bf16_inductor_ro"),
            ("fp8_rowwise", "fp8"),
            ("fp8_rowwise_ro", "fp8_ro"),
            ("fp8_ckpt", "transformers_fp8"),
            ("fp8_ckpt", "transformers_fp8_inductor"),
            ("fp8_ro_ckpt", "transformers_fp8_inductor_ro"),
            ("fp8_ro_ckpt", "fp8_ro"),  # on the FP8 checkpoint against on the bf16 model
            ("fp8_ro_own_ckpt", "fp8_ro_own"),
            ("fp8_ro", "bf16_gqa_ro"),
            ("bf16_gqa_ro", "bf16_inductor_ro"),
            # a variant run with options: beside bf16 Inductor in its mode, and the variant it changes
            *(
                (v, "bf16_inductor_ro" if "ro" in v.split("+")[0].split("_") else "bf16_inductor")
                for v in variants
                if "+" in v
            ),
            *((v, v.split("+")[0]) for v in variants if "+" in v),
        ):
            if fp8 not in variants or bf16 not in variants:
                continue
            ratios = []
            for b in batches:
                a, z = get.get((fp8, "decode", b)), get.get((bf16, "decode", b))
                ratios.append(f"{a['tokens_per_s'] / z['tokens_per_s']:>18.2f}" if a and z else f"{'-':>18}")
            pre = ""
            for b in prefills:
                a, z = get.get((fp8, "prefill", b)), get.get((bf16, "prefill", b))
                pre += f"{a['tokens_per_s'] / z['tokens_per_s']:>11.2f}" if a and z else f"{'-':>11}"
            firsts = [
                max(
                    (r["first_call_s"] for r in mine if r["variant"] == v and "first_call_s" in r),
                    default=None,
                )
                for v in (fp8, bf16)
            ]
            first = f"{firsts[0] / firsts[1]:>11.2f}" if None not in firsts else f"{'-':>11}"
            lines.append(f"{fp8 + '/' + bf16:<20}" + "".join(ratios) + pre + first)
        limited = [r for r in mine if r["kind"] == "decode" and r.get("read_limit_ms")]
        if limited:
            lines.append(
                f"decode against its read limit (weights and live KV bytes a step must read, at "
                f"{limited[0]['read_tbps']:.2f} TB/s, this GPU's plain read): GB, limit ms, "
                "share of it reached by wall time (and by GPU time, --profile)"
            )
            lines += [
                f"{r['variant']:<20}{_step_name(r):>8}{r['step_read_gb']:>8.2f}{r['read_limit_ms']:>8.2f}"
                f"{r['wall_of_limit']:>8.0%}" + (f"{r['gpu_of_limit']:>8.0%}" if "gpu_of_limit" in r else "")
                for r in limited
            ]
            sharded = [r for r in limited if r.get("all_reduces_ms") is not None]
            if sharded:
                lines.append(
                    "and with the step's all-reduces, each at its time alone (bench allreduce's timing): "
                    "their ms, the limit with them, the share of it reached by wall time"
                )
                lines += [
                    f"{r['variant']:<20}{_step_name(r):>8}{r['all_reduces_ms']:>8.2f}"
                    f"{r['limit_with_all_reduces_ms']:>8.2f}{r['wall_of_limit_with_all_reduces']:>8.0%}"
                    for r in sharded
                ]
        split = [r for r in mine if r.get("kernel_ms_per_step")]
        if split:
            kinds = list(split[0]["kernel_ms_per_step"])
            lines.append(
                "GPU time per decode step (or prefill) by kernel kind, ms (--profile): " + ", ".join(kinds)
            )
            lines += [
                f"{r['variant']:<20}{_step_name(r):>8}"
                + "".join(f"{r['kernel_ms_per_step'][k]:>10.2f}" for k in kinds)
                for r in split
            ]
            for r in split:
                lines.append(
                    f"top kernels, {r['variant']} {_step_name(r)}, ms per step (x launches per step): "
                    + "; ".join(
                        f"{name[:60]} ({kind}) {ms:.3f}" + "".join(f" x{n:g}" for n in launches[:1] if n)
                        for name, kind, ms, *launches in r.get("top_kernels_ms_per_step", [])[:6]
                    )
                )
                if r.get("gpu_profile_steps") == "subtracted":  # gpu_time.decode_steps's fallback
                    lines.append(
                        "  (the steps' kernels as the whole call's less a prompt-only call's: the whole "
                        "call did not begin with the prompt's kernels, and collective waits may not cancel)"
                    )
            for r in split:
                if "gpu_idle_ms_per_step" in r:
                    lines.append(
                        f"GPU idle, {r['variant']} {_step_name(r)}: {r['gpu_idle_ms_per_step']:.3f} ms per "
                        "step, most between: "
                        + "; ".join(f"{where} {ms:.3f}" for where, ms in r["top_gpu_idle_ms_per_step"][:4])
                    )
                if "gpu_idle_ms_per_step_by_owner" in r:
                    owners = sorted(r["gpu_idle_ms_per_step_by_owner"].items(), key=lambda item: -item[1])
                    lines.append(
                        "  by owner (what the host did meanwhile; a short gap, the kernel boundaries), ms "
                        "per step: " + "; ".join(f"{who} {ms:.3f}" for who, ms in owners)
                    )
    return "\n".join(lines)


def _step_name(row: dict) -> str:
    return "prefill" if row["kind"] == "prefill" else f"B={row['batch']}"


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        decode_rows = [r for r in rows if r["model"] == model and r["kind"] == "decode"]
        for v in dict.fromkeys(r["variant"] for r in decode_rows):
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in decode_rows if r["variant"] == v)
            ax.plot(*zip(*pts), marker="o", lw=2.5 if v.startswith("fp8") else 1, label=v)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="batch",
            ylabel="decode tokens/s",
            title=f"{model} ({decode_rows[0]['layers'] if decode_rows else '?'} layers)",
        )
        ax.set_xscale("log", base=2)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"fp8compile, whole models, {rows[0]['device'] if rows else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)

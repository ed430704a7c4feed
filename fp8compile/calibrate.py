"""Static activation scales: calibrate a bf16 model on the user's batches, save and load the table.

    config = fp8compile.calibrate(model, batches, recipe="tensor")   # runs the bf16 model eagerly
    fp8compile.save_scales(config, "scales.pt")
    model = torch.compile(model, backend=fp8compile.backend(recipe="tensor",
                          act_amax=fp8compile.load_scales("scales.pt", model)))

Calibration records, for every nn.Linear, the largest |value| its input took over the batches;
the compiled graph then quantizes that linear's input with the constant scale amax / 448 (no
amax reduction at run time), values past it saturating at +-448. Linears over one input merged
into one GEMM (q/k/v, gate/up) take the largest of their amax. A linear that is not an
nn.Linear module (a bare parameter in F.linear) is not seen here and stays bf16 in the compiled
model, with the reason in its report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .config import Fp8Config, make_config

FORMAT = "fp8compile.act_amax/1"


def calibrate(model: torch.nn.Module, batches: Iterable[Any], **options: Any) -> Fp8Config:
    """Run the model (eagerly, in its own precision, under no_grad) on each batch (a tensor, a
    tuple of positional arguments or a dict of keyword arguments) and return the config of
    `options` (recipe "rowwise" or "tensor"; default "tensor") with act_amax set from the inputs
    every nn.Linear saw. The model is not modified."""
    options.setdefault("recipe", "tensor")
    options.pop("act_amax", None)
    if options["recipe"] == "block":
        raise ValueError("static activation scales serve the rowwise and tensor recipes, not 'block'")
    make_config(**options)  # a bad option is an error before the model runs
    amax: dict[str, float] = {}

    def record(name):
        def hook(module, args):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.numel():
                amax[name] = max(amax.get(name, 0.0), float(x.detach().abs().amax()))

        return hook

    handles = [
        module.register_forward_pre_hook(record(name))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    runs = 0
    try:
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, Mapping):
                    model(**batch)
                elif isinstance(batch, (tuple, list)):
                    model(*batch)
                else:
                    model(batch)
                runs += 1
    finally:
        for handle in handles:
            handle.remove()
    if not runs:
        raise ValueError("calibrate needs at least one batch")
    if not amax:
        raise ValueError("calibration saw no nn.Linear run on a non-empty input: nothing to calibrate")
    # An all-zero input leaves amax 0: no scale can be made from it; use the smallest positive.
    floor = min((v for v in amax.values() if v > 0), default=1.0)
    return make_config(**options, act_amax={k: v if v > 0 else floor for k, v in amax.items()})


def _table(scales: Fp8Config | Mapping[str, float]) -> dict[str, float]:
    table = scales.act_amax if isinstance(scales, Fp8Config) else scales
    if table is None:
        raise ValueError("this config has no static activation scales (act_amax is None): calibrate first")
    return {str(k): float(v) for k, v in table.items()}


def save_scales(scales: Fp8Config | Mapping[str, float], path) -> None:
    """Write a calibrated act_amax table (or a config holding one) to `path` (torch.save)."""
    torch.save({"format": FORMAT, "act_amax": _table(scales)}, path)


def load_scales(path, model: torch.nn.Module | None = None) -> dict[str, float]:
    """The act_amax table saved at `path`. With `model`: every name in it must be an nn.Linear of
    the model, else ValueError naming the strangers (a table calibrated on another model)."""
    data = torch.load(path, weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an activation scale table saved by fp8compile.save_scales")
    table = _table(data["act_amax"])
    if model is not None:
        linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        strangers = sorted(set(table) - linears)
        if strangers:
            shown = ", ".join(strangers[:5]) + (
                f" and {len(strangers) - 5} more" if len(strangers) > 5 else ""
            )
            raise ValueError(
                f"the scale table at {path} does not match this model: {len(strangers)} of its "
                f"{len(table)} names are no nn.Linear of it ({shown}); calibrate on this model"
            )
    return table

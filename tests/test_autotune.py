"""Autotune (Fp8Config(autotune=True)): the kernel for each range of M is the one measured fastest
on this GPU for the call site's shape; a kernel takes over only where it is clearly faster, only
for rows it serves, and never if it fails to run. Timing itself needs a GPU: here it is replaced
by synthetic times, which is what these tests are about (the choice, not the clock)."""

import pytest
import torch
from torch import nn

import fp8compile
from fp8compile import autotune, registry
from tests.conftest import BF16, CountingBackend, randn

CPU = torch.device("cpu")


@pytest.fixture
def kernels(monkeypatch):
    """Two synthetic backends, "low" (any M) and "high" (M >= 8), and a switch to make them fail."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    monkeypatch.setattr(registry, "DEFAULT_ORDERS", dict(registry.DEFAULT_ORDERS))
    impl = {"linear": registry.implementation("linear", "reference")}
    registry.register(registry.Backend("low", impl, lambda r: None))
    registry.register(registry.Backend("high", impl, lambda r: "needs M >= 8" if r.m_min < 8 else None))


def ranges(time, static_m=None, order=("low", "high", "reference")):
    return autotune.tuned_ranges(registry.Request("linear", CPU, 4096, 4096), order, time, static_m)


def test_each_range_of_m_gets_the_kernel_measured_fastest_there(kernels):
    # low: 10 + 0.1 M us, high: 30 + 0.01 M us; high is >= 5% faster from M = 256 on (35.6 vs 32.6)
    time = lambda name, m: 10 + 0.1 * m if name == "low" else 30 + 0.01 * m  # noqa: E731
    assert ranges(time) == [(1, 192, "low"), (193, None, "high")]


def test_a_kernel_only_marginally_faster_adds_no_range(kernels):
    time = lambda name, m: 100.0 if name == "low" else 97.0  # noqa: E731  3% faster: within MIN_GAIN
    assert ranges(time) == [(1, None, "low")]


def test_a_kernel_is_chosen_only_for_rows_it_serves(kernels):
    time = lambda name, m: 50.0 if name == "low" else 1.0  # noqa: E731  high is fastest but serves M >= 8 only
    # the ladder's step (4, 8] holds M = 5..7, which high cannot serve: low keeps it
    assert ranges(time) == [(1, 8, "low"), (9, None, "high")]


def test_a_kernel_that_fails_to_run_does_not_compete(kernels):
    time = lambda name, m: None if name == "high" else 5.0  # noqa: E731
    assert ranges(time) == [(1, None, "low")]


def test_the_reference_is_the_fallback_not_a_contender(kernels):
    assert ranges(lambda name, m: None) == [(1, None, "reference")]
    with pytest.raises(RuntimeError, match="failed to run"):
        ranges(lambda name, m: None, order=("low", "high"))


def test_a_static_m_is_timed_at_that_m_only(kernels):
    seen = []
    ranges(lambda name, m: seen.append(m) or 1.0, static_m=7)
    assert set(seen) == {7}


def test_compiled_linear_dispatches_on_the_tuned_ranges_in_one_graph(probe_backend, captured, monkeypatch):
    # "probe" (M <= 32) and "mid" (bounded ranges above 32) are the only timed kernels that serve
    # their ranges; M above the ladder's last step falls back to the reference.
    monkeypatch.setattr(autotune, "can_tune", lambda device: True)
    monkeypatch.setattr(autotune, "time_us", lambda op, name, n, k, m, device, e8m0: 1.0)
    model = nn.Linear(256, 384).to(BF16)
    backend = CountingBackend(backends=["probe", "mid", "reference"], autotune=True)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for m in (3, 45, 5000):
            x = randn(m, 256)
            torch._dynamo.mark_dynamic(x, 0)
            assert fp8compile.calc_diff(compiled(x), model(x)) < 1e-3
    assert backend.compiles == 1
    assert probe_backend == [("linear", 3), ("mid:linear", 45)]
    last = autotune.TUNE_MS[-2]
    (rewrite,) = backend.report.rewrites
    assert rewrite.kernels == (
        ("M <= 32", "probe"),
        (f"32 < M <= {last}", "mid"),
        (f"M > {last}", "reference"),
    )
    assert captured[0].count(torch.ops.higher_order.cond) == 2


def test_autotune_is_off_by_default_and_validated():
    assert fp8compile.Fp8Config().autotune is False
    with pytest.raises(TypeError, match="autotune must be True or False"):
        fp8compile.backend(autotune="yes")

"""ops/launch.py: a Triton kernel relaunched from its compiled form, keyed by what Triton
specializes on; Triton's own path for a new signature and an unknown argument kind; the C
launcher called directly while no launch hook is set, the compiled kernel's runner (which calls
the hooks) while one is."""

import types

import pytest
import torch

from fp8compile.ops import launch


class FakeCompiled:
    """A compiled kernel: `run` is its C launcher, `[grid](*args)` its runner."""

    function, packed_metadata = "cu_function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit, *args):
        self.log.append(
            ("direct", (gx, gy, gz), stream, (function, metadata, launch_metadata, enter, exit), args)
        )

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("fast", grid, args))


class Hooks:
    """Triton's launch hooks as Triton 3.6+ holds them: chains that are never None, maybe empty."""

    def __init__(self, *calls):
        self.calls = list(calls)


@pytest.fixture(autouse=True)
def fake_triton_runtime(monkeypatch):
    """The current stream and Triton's hook knobs, without a GPU."""
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 1234)
    runtime = types.SimpleNamespace(launch_enter_hook=Hooks(), launch_exit_hook=Hooks())
    monkeypatch.setattr(launch, "_knobs", types.SimpleNamespace(runtime=runtime))
    return runtime


class FakeKernel:
    """kernel[grid](*args, **constexprs, **options), as a @triton.jit function takes it."""

    arg_names = ["x", "n", "scale", "BLOCK", "ACT"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.log)

        return run


def test_a_signature_seen_before_is_relaunched_with_constexprs_in_signature_order():
    kernel = FakeKernel()
    run = launch.Launcher(kernel)
    x = torch.zeros(64)
    for n in (32, 48):  # both multiples of 16 and not 1: one signature
        run((4,), (x, n, 0.5), {"ACT": 1, "BLOCK": 128}, num_warps=4)
    assert [e[0] for e in kernel.log] == ["triton", "direct"]
    # no hooks set: no launch metadata, no hooks, the current stream
    assert kernel.log[1] == (
        "direct",
        (4, 1, 1),
        1234,
        ("cu_function", "metadata", None, None, None),
        (x, 48, 0.5, 128, 1),
    )


def test_while_a_launch_hook_is_set_the_relaunch_goes_through_the_runner_that_calls_it(fake_triton_runtime):
    kernel = FakeKernel()
    run = launch.Launcher(kernel)
    x = torch.zeros(64)
    fake_triton_runtime.launch_enter_hook = Hooks(print)  # e.g. a profiler
    for _ in range(2):
        run((4,), (x, 32, 0.5), {"ACT": 1, "BLOCK": 128})
    fake_triton_runtime.launch_enter_hook = Hooks()
    run((4,), (x, 32, 0.5), {"ACT": 1, "BLOCK": 128})
    assert [e[0] for e in kernel.log] == ["triton", "fast", "direct"]


@pytest.mark.parametrize(
    "change", ["int_not_multiple_of_16", "int_one", "dtype", "misaligned", "constexpr", "option"]
)
def test_what_triton_specializes_on_takes_triton_s_path_again(change):
    kernel = FakeKernel()
    run = launch.Launcher(kernel)
    x = torch.zeros(64)
    args, constexprs, options = (x, 32, 0.5), {"BLOCK": 128, "ACT": 1}, {"num_warps": 4}
    run((4,), args, constexprs, **options)
    if change == "int_not_multiple_of_16":
        args = (x, 33, 0.5)
    elif change == "int_one":
        args = (x, 1, 0.5)
    elif change == "dtype":
        args = (x.half(), 32, 0.5)
    elif change == "misaligned":
        args = (x[1:], 32, 0.5)
    elif change == "constexpr":
        constexprs = {"BLOCK": 64, "ACT": 1}
    else:
        options = {"num_warps": 8}
    run((4,), args, constexprs, **options)
    assert [e[0] for e in kernel.log] == ["triton", "triton"]


def test_an_argument_of_another_kind_takes_triton_s_path_every_time():
    kernel = FakeKernel()
    run = launch.Launcher(kernel)
    for _ in range(2):
        run((1,), (torch.zeros(4), 16, object()), {"BLOCK": 1, "ACT": 0})
    assert [e[0] for e in kernel.log] == ["triton", "triton"]


def test_a_relaunch_the_installed_triton_refuses_falls_back_to_its_own_path_for_good():
    class Refusing(FakeCompiled):
        def run(self, *args):
            raise TypeError("function takes exactly 20 arguments (22 given)")

    refusing = type(
        "RefusingKernel",
        (FakeKernel,),
        {
            "__getitem__": lambda self, grid: (
                lambda *a, **k: self.log.append(("triton", grid, a, k)) or Refusing(self.log)
            )
        },
    )()
    run = launch.Launcher(refusing)
    for _ in range(3):
        run((2,), (torch.zeros(4), 16, 1.0), {"BLOCK": 1, "ACT": 0})
    assert [e[0] for e in refusing.log] == ["triton", "triton", "triton"] and not run.relaunch


def test_signatures_past_the_cap_are_forgotten_and_relearned(monkeypatch):
    monkeypatch.setattr(launch, "MAX_SIGNATURES", 2)
    kernel = FakeKernel()
    run = launch.Launcher(kernel)
    x = torch.zeros(64)
    for n in (1, 32, 33, 32):  # three signatures: the third starts the table over, so 32 is new again
        run((4,), (x, n, 0.5), {"ACT": 1, "BLOCK": 128})
    assert [e[0] for e in kernel.log] == ["triton"] * 4 and len(run.compiled) == 2
    run((4,), (x, 32, 0.5), {"ACT": 1, "BLOCK": 128})
    assert kernel.log[-1][0] == "direct"


def test_a_static_key_stands_for_the_constexprs_and_options_it_was_given_with():
    """Launcher.launch keys a signature by the caller's static key instead of the constexprs'
    values: the same key object relaunches, another key is a new signature."""
    kernel = FakeKernel()
    run = launch.Launcher(kernel)
    x = torch.zeros(64)
    constexprs, options = {"BLOCK": 128, "ACT": 1}, {"num_warps": 4}
    kept, other = object(), object()
    for key in (kept, kept, other):
        run.launch((4,), (x, 32, 0.5), constexprs, options, key)
    assert [e[0] for e in kernel.log] == ["triton", "direct", "triton"]

"""Inductor's analysis of a user-defined Triton kernel (which tensors it reads and writes) is
asked once per specialization while our graphs compile (fp8compile/kernel_analysis.py): a
question that differs only in what the analysis throws away (symbolic sizes, a fake tensor's
shape) gets the first answer; one that differs in what it keeps (a dtype, a constant) is asked
again; a question about real tensors is always asked."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fp8compile import kernel_analysis

wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")


class Kernel:
    """Stands for a Triton kernel: the memo keys on the object, never calls it."""


@pytest.fixture
def counted(monkeypatch):
    """The torch analysis replaced by one that records each question it is asked; the memo's
    table emptied."""
    asked = []

    def analysis(kernel, kwargs, tma_descriptor_metadata):
        asked.append(dict(kwargs))
        return {"writes": sorted(name for name, value in kwargs.items() if isinstance(value, torch.Tensor))}

    name = next(name for name in kernel_analysis.ANALYSES if hasattr(wrap, name))
    monkeypatch.setattr(wrap, name, analysis)
    monkeypatch.setattr(kernel_analysis, "_ANSWERS", {})
    return name, asked


def fakes(*shapes, dtype=torch.bfloat16):
    with FakeTensorMode():
        return [torch.empty(shape, dtype=dtype) for shape in shapes]


def ask(name, kernel, **kwargs):
    return getattr(wrap, name)(kernel, kwargs, {})


def test_call_sites_that_differ_only_in_sizes_share_one_analysis(counted):
    name, asked = counted
    kernel = Kernel()
    (x1, out1), (x2, out2) = fakes((1, 4096), (1, 6144)), fakes((16, 14336), (16, 4096))
    with kernel_analysis.memoized():
        first = ask(name, kernel, x_ptr=x1, out_ptr=out1, N=6144, BLOCK_N=64)
        again = ask(name, kernel, x_ptr=x2, out_ptr=out2, N=6144, BLOCK_N=64)
    assert len(asked) == 1
    assert first == again == {"writes": ["out_ptr", "x_ptr"]}
    again["writes"].append("mutated by a caller")
    with kernel_analysis.memoized():
        assert ask(name, kernel, x_ptr=x1, out_ptr=out1, N=6144, BLOCK_N=64) == {
            "writes": ["out_ptr", "x_ptr"]
        }


def test_a_symbolic_size_is_one_key_whatever_its_symbol(counted):
    name, asked = counted
    kernel, env = Kernel(), ShapeEnv()
    m1, m2 = env.create_unbacked_symint(), env.create_unbacked_symint()
    with kernel_analysis.memoized():
        ask(name, kernel, M=m1, BLOCK_M=16)
        ask(name, kernel, M=m2, BLOCK_M=16)
        ask(name, kernel, M=7, BLOCK_M=16)  # a constant M is kept by the analysis
    assert len(asked) == 2


def test_what_the_analysis_keeps_is_asked_again(counted):
    name, asked = counted
    kernel, other = Kernel(), Kernel()
    (bf16,), (fp8,) = fakes((4, 128)), fakes((4, 128), dtype=torch.float8_e4m3fn)
    with kernel_analysis.memoized():
        ask(name, kernel, x_ptr=bf16, BLOCK_K=128)
        ask(name, kernel, x_ptr=fp8, BLOCK_K=128)  # another dtype
        ask(name, kernel, x_ptr=bf16, BLOCK_K=64)  # another constant
        ask(name, other, x_ptr=bf16, BLOCK_K=128)  # another kernel
        ask(name, kernel, x_ptr=bf16, BLOCK_K=128, EVEN_K=True)  # another argument
        ask(name, kernel, x_ptr=bf16, BLOCK_K=128)  # the first question again
    assert len(asked) == 5


def test_real_tensors_and_unhashable_arguments_are_always_asked(counted):
    name, asked = counted
    kernel = Kernel()
    with kernel_analysis.memoized():
        for _ in range(2):
            ask(name, kernel, x_ptr=torch.empty(4))  # Triton would specialize on its address
            ask(name, kernel, grid=[1, 2])
    assert len(asked) == 4


def test_the_torch_functions_are_restored_after_the_compile(counted):
    name, _ = counted
    analysis = getattr(wrap, name)
    with kernel_analysis.memoized():
        assert getattr(wrap, name) is not analysis
        with kernel_analysis.memoized():  # a compile inside a compile wraps once
            assert getattr(wrap, name).__wrapped_analysis__ is analysis
    assert getattr(wrap, name) is analysis

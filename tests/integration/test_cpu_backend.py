"""The CPU rehearsal backend, each case in a fresh process: CUDA placement lands on the CPU, megatron's CUDA checks
pass, RNG maps to the CPU generator."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is inactive on GPU machines")


def _run(code: str) -> str:
    """Each case in a fresh interpreter: install() patches process-wide state for good."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_cuda_literals_and_indices_land_on_cpu():
    out = _run("""
        import torch
        from megatron_ext.distributed import cpu_backend
        assert cpu_backend.install() is True and cpu_backend.install() is True  # idempotent
        a = torch.zeros(2, device="cuda")
        b = torch.empty(3, device=torch.cuda.current_device())
        c = torch.ones(2).to("cuda")
        d = torch.ones(2, device=torch.device("cuda", 0)).cuda()
        e = torch.tensor([1, 2], pin_memory=True, device="cuda").pin_memory()
        print(a.device, b.device, c.device, d.device, e.device)
    """)
    assert out == "cpu cpu cpu cpu cpu"


def test_tensor_type_reports_cuda_name_but_conversions_still_work():
    out = _run("""
        import torch
        from megatron_ext.distributed import cpu_backend
        cpu_backend.install()
        t = torch.ones(2)
        print(t.type(), t.type(torch.float64).dtype)
    """)
    assert out == "torch.cuda.FloatTensor torch.float64"


def test_backward_inside_megatron_autograd_functions_allocates_on_cpu():
    """The whole backward runs inside torch.autograd.backward, where the mode is not active."""
    out = _run("""
        import torch
        from megatron_ext.distributed import cpu_backend
        cpu_backend.install()
        class UsesCurrentDevice(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2
            @staticmethod
            def backward(ctx, g):
                return g + torch.zeros(g.shape, device=torch.cuda.current_device())
        x = torch.ones(3, requires_grad=True)
        torch.autograd.backward(UsesCurrentDevice.apply(x).sum())
        print(x.grad.tolist())
    """)
    assert out == "[1.0, 1.0, 1.0]"


def test_megatron_rng_tracker_forks_the_cpu_generator_reproducibly():
    out = _run("""
        import torch
        from megatron_ext.distributed import cpu_backend
        cpu_backend.install()
        from megatron.core.tensor_parallel import random as r
        r.get_cuda_rng_tracker().add("stream", 7)
        torch.manual_seed(0)
        with r.get_cuda_rng_tracker().fork("stream"):
            a = torch.rand(2)
        outside = torch.rand(2)
        torch.manual_seed(0)
        expected_outside = torch.rand(2)
        g = torch.Generator().manual_seed(7)
        print(torch.equal(a, torch.rand(2, generator=g)), torch.equal(outside, expected_outside))
    """)
    assert out == "True True"



"""CPU rehearsal defers megatron-core's import-time torch.compile decorations (megatron_ext/distributed/
deferred_compile.py): importing it leaves torch's compiler stack unimported, and a decorated function is compiled
when it is first called and gives what it gave before."""

from __future__ import annotations

import subprocess
import sys

from megatron_ext.distributed.deferred_compile import compile_on_first_call
from tests.launch import ROOT

PROBE = """
import sys
import torch
import megatron_ext
from megatron.core.fusions.fused_bias_swiglu import swiglu  # decorated with megatron-core's jit_fuser
from megatron.core.transformer.moe.router import InferenceTopKRouter  # decorated with @torch.compile
print("after import:", "torch._dynamo" in sys.modules)
y = torch.randn(4, 6)
a, b = torch.chunk(y, 2, -1)
print("same values:", torch.allclose(swiglu(y), torch.nn.functional.silu(a) * b))
print("after the first call:", "torch._dynamo" in sys.modules)
"""


def test_importing_megatron_core_no_longer_imports_the_compiler_and_the_first_call_compiles():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["after import: False", "same values: True", "after the first call: True"]


def test_a_deferred_function_compiles_once_with_its_options_and_runs_as_it_is_while_traced():
    compiled, tracing = [], [False]

    def compile_now(fn, **options):
        compiled.append(options)
        return lambda *args: ("compiled", fn(*args))

    deferred = compile_on_first_call(compile_now, lambda: tracing[0])

    @deferred(dynamic=False)
    def double(x):
        return 2 * x

    assert compiled == [] and double.__name__ == "double"
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8) and compiled == [{"dynamic": False}]
    tracing[0] = True
    assert double(5) == 10  # dynamo traces into the plain function, as into a compiled one

"""CPU rehearsal defers the ``torch.compile`` decorations megatron-core makes while it is imported.

``import megatron.core`` decorates functions with ``torch.compile`` (its ``jit_fuser`` fusions of elementwise ops,
the inference router's top-k). Each decoration imports torch's compiler stack (dynamo, inductor, triton): about 1.3 s
of the 5.5 s a training process spends importing, on the 2-core CI machine (docs/measurements/startup-2026-11-26.md),
although a rehearsal calls few of those functions, if any, and the suite starts hundreds of processes.

While megatron-core's package executes in a process without a GPU, ``torch.compile`` is a stand-in that returns a
function compiling the decorated one, with the same options, the first time it is called: what runs is compiled as
before, what never runs costs nothing. Decorations made later, and the project's own ``torch.compile`` of decoder
layers (``train.compile``), are torch's own; on a GPU nothing changes. A process that imported megatron-core before
``megatron_ext`` keeps megatron-core's behaviour.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

PACKAGE = "megatron.core"


def compile_on_first_call(compile_now: Callable[..., Any], is_compiling: Callable[[], bool]) -> Callable[..., Any]:
    """A ``torch.compile`` whose result compiles the function with `compile_now` when it is first called, and runs it
    as it is while `is_compiling` (dynamo is tracing its caller)."""

    def compile_later(model: Optional[Callable[..., Any]] = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile_later(fn, **options)
        compiled: Optional[Callable[..., Any]] = None

        @functools.wraps(model)
        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if is_compiling():  # inside a compiled region (train.compile): traced into it, as a compiled one is
                return model(*args, **kwargs)
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return run

    return compile_later


class _DeferringCompiles(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch

        from megatron_ext.distributed import cpu_backend

        if not cpu_backend.needed():
            self.loader.exec_module(module)
            return
        compile_now = torch.compile
        torch.compile = compile_on_first_call(compile_now, torch.compiler.is_compiling)
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = compile_now


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != PACKAGE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferringCompiles(spec.loader)
        return spec


def install() -> None:
    """Defer megatron-core's import-time compiles in this process, unless megatron-core is imported already."""
    if PACKAGE not in sys.modules and not any(isinstance(f, _MegatronCoreFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MegatronCoreFinder())

"""Thin extensions on megatron-core, one package per concern: training (the loop) above checkpoint, resilience,
metrics and planner, above model, data, distributed and convert, above config, above errors and hardware
(docs/architecture.md; the layers are import-linter contracts in pyproject.toml)."""

import logging
import re
import warnings

from megatron_ext.distributed import deferred_compile

# megatron-core warns at import time that TE/Apex are missing; the layer spec actually chosen
# (TE, or local + SDPA) is logged at start-up instead, so these would only be noise.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) .*not installed")

# torch's CUDA build on a machine without a GPU but with a CUDA toolkit logs "No CUDA runtime is found" when
# torch.utils.cpp_extension is imported (megatron-core >= 0.17 imports it in tensor_parallel.random): true, and
# nothing to act on in a CPU rehearsal; on a GPU it is never said.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

deferred_compile.install()


class _Dropping(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def drop_messages(logger: str, pattern: str) -> None:
    """Drop the records `logger` itself logs whose message matches `pattern` (a regular expression)."""
    logging.getLogger(logger).addFilter(_Dropping(pattern))


# megatron-core's start-up messages a recipe user cannot act on (docs/architecture.md says what the project does
# about each)
for _logger, _fragment in (
    # every model build: the recipes build GPTModel until the move to HybridModel
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    # every DDP build with the distributed optimizer: DDP computes the layout itself, as the caller would
    ("megatron.core.distributed.distributed_data_parallel", "full_param_layout not provided"),
    # the first synchronous save of every rank: megatron-core's synchronous save is its own (deprecated) asynchronous
    # one, waited for; the asynchronous saves run NVRx's writer (checkpoint/async_save.py)
    ("megatron.core.dist_checkpointing.strategies.torch", "async save is deprecated"),
    # every save with the distributed optimizer at DP > 1, from each DP rank but the first: its optimizer state carries
    # an empty entry (``param_state: None``, seen 2026-11-26) that rank 0's, the common state saved, does not (resumes
    # across DP sizes are exact: tests/integration/test_checkpoint_safety.py); any other difference is still said
    ("megatron.core.dist_checkpointing.validation", r"common state dict differs from rank 0 common state dict\. Keys "
     r"only on rank 0: \[\], Keys only on \d+: \[\('optimizer', (\d+, )?'param_state'\)(, \('optimizer', (\d+, )?"
     r"'param_state'\))*\], Mismatched keys: \[\]$"),
):
    drop_messages(_logger, _fragment)

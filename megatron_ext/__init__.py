"""Thin extensions on megatron-core, one package per concern: training (the loop) above checkpoint, resilience,
metrics and planner, above model, data, distributed and convert, above config, above errors and hardware
(docs/architecture.md; the layers are import-linter contracts in pyproject.toml)."""

import logging
import warnings

# megatron-core warns at import time that TE/Apex are missing; the layer spec actually chosen
# (TE, or local + SDPA) is logged at start-up instead, so these would only be noise.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) .*not installed")

# torch's CUDA build on a machine without a GPU but with a CUDA toolkit logs "No CUDA runtime is found" when
# torch.utils.cpp_extension is imported (megatron-core >= 0.17 imports it in tensor_parallel.random): true, and
# nothing to act on in a CPU rehearsal; on a GPU it is never said.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


class _Dropping(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def drop_messages(logger: str, fragment: str) -> None:
    """Drop the records `logger` itself logs whose message contains `fragment`."""
    logging.getLogger(logger).addFilter(_Dropping(fragment))


# megatron-core's start-up messages a recipe user cannot act on (docs/architecture.md says what the project does
# about each)
for _logger, _fragment in (
    # every model build: the recipes build GPTModel until the move to HybridModel
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    # every DDP build with the distributed optimizer: DDP computes the layout itself, as the caller would
    ("megatron.core.distributed.distributed_data_parallel", "full_param_layout not provided"),
    # the first save of every rank, synchronous ones included (its synchronous save is the asynchronous one, waited
    # for): megatron-core's writer is the one chosen (checkpoint/save_load.py)
    ("megatron.core.dist_checkpointing.strategies.torch", "async save is deprecated"),
):
    drop_messages(_logger, _fragment)

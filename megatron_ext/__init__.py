"""Thin extensions on megatron-core, one package per concern: training (the loop) above checkpoint, resilience,
metrics and planner, above model, data, distributed and convert, above config, above errors and hardware
(docs/architecture.md; the layers are import-linter contracts in pyproject.toml)."""

import warnings

# megatron-core warns at import time that TE/Apex are missing; the layer spec actually chosen
# (TE, or local + SDPA) is logged at start-up instead, so these would only be noise.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) .*not installed")

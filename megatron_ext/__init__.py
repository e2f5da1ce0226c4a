"""Thin extensions on top of megatron-core: model spec, training loop, checkpoints, logging, CPU rehearsal."""

import warnings

# megatron-core warns at import time that TE/Apex are missing; the layer spec actually chosen
# (TE, or local + SDPA) is logged at start-up instead, so these would only be noise.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) .*not installed")

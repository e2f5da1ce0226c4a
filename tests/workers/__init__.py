"""Processes the integration tests start: torchrun workers with a fault or a measurement patched in, and the
TransformerEngine-shaped stand-in."""

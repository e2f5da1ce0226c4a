"""Runnable recipes: the pretraining entry point and the tools around it."""

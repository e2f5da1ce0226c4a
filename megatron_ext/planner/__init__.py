"""The layout planner: per-GPU memory and step time of every valid TP/PP/VPP/CP/DP layout for a recipe."""

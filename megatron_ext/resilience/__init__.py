"""Failures and how a job survives them: one message per failure with its exit code, divergence checks, the hang
watchdog, straggler detection, the job's shared store, the orphan guard, what a restart changed and cost, and the
elastic agent recipes.launch runs (torchrun's or NVRx's ft_launcher, with its rank heartbeats)."""

"""Failures and how a job survives them: one message per failure with its exit code, divergence checks, the hang watchdog, straggler detection, the job's shared store and the orphan guard."""

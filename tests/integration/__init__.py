"""The recipe run for real: torchrun worlds on CPU (gloo), its command-line tools, conversions against
transformers, failures injected into running jobs, the SLURM test cluster. Each test starts processes."""

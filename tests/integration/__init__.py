"""The recipe run for real: worlds of ranks on CPU (gloo), its command-line tools, conversions against
transformers, failures injected into running jobs, the SLURM test cluster. Each test starts processes: forked from
the session's imported interpreter (conftest.py, tests/zygote.py) where the launch is not what it tests, else by the
launchers users run."""

"""The elastic agent that runs the ranks under ``recipes.launch``, and what this project changes in it.

Two agents: torchrun's, or NVIDIA Resiliency Extension's ``ft_launcher`` (``recipes.launch --nvrx``), a subclass of
torch's elastic agent that adds rank heartbeats watched from outside the ranks (:mod:`.nvrx`) and node health
checks. Both get the same four changes, made once per process by :func:`prepare`:

* a failure whose exit code a restart would repeat (NOT_RESTARTED: config/data/checkpoint errors, divergence) ends
  the job at once instead of using up ``--max-restarts``;
* a run that fails names the ranks that failed (NVRx 0.6.0 loses them when it runs out of restarts);
* the agent's environment, which the workers it starts inherit, records when it decided to restart them, had
  stopped the old ones and had the new world's rendezvous (:mod:`.elastic` says where a recovery went);
* SIGTERM or Ctrl-C to the launcher reaches the ranks as SIGTERM, on which they checkpoint at the next step boundary
  (SIGINT would interrupt them without a checkpoint); the exception remembers the signal received.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import time
from types import ModuleType
from typing import Any, Callable

from megatron_ext.errors import EXIT_DIVERGED, EXIT_STORAGE, EXIT_USER_ERROR, ConfigError
from megatron_ext.resilience.elastic import RENDEZVOUS_DONE_AT, RESTART_DECIDED_AT, WORKERS_STOPPED_AT

# A restart would fail the same way: fix the config/data/checkpoint, or the run's numerics, first.
NOT_RESTARTED = (EXIT_USER_ERROR, EXIT_DIVERGED, EXIT_STORAGE)
NVRX_VERSION = "0.6.0"  # megatron-core 0.19 refuses to import beside an older NVRx; requirements-nvrx.txt pins it


@dataclasses.dataclass(frozen=True)
class Agent:
    """One agent implementation: its command line, its launch and the classes this module changes."""

    name: str
    parse_args: Callable[[list[str]], Any]
    config_from_args: Callable[[Any], tuple]
    run: Callable[[Any], None]
    simple_agent: type  # SimpleElasticAgent: restarts, rendezvous
    local_agent: type  # LocalElasticAgent: worker monitoring
    worker_state: type
    processes: ModuleType  # elastic.multiprocessing.api: the signal handler it installs, SignalException
    child_failed: type  # ChildFailedError


def agent(nvrx: bool) -> Agent:
    """torchrun's agent, or NVRx's ft_launcher (its ``--ft-*`` options then apply), prepared. NVRx >= 0.6's
    ft_launcher subclasses torch's elastic agent and uses torch's worker processes and errors, so both agents share
    those classes."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.multiprocessing import api as processes
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if nvrx:
        if importlib.util.find_spec("nvidia_resiliency_ext") is None:
            raise ConfigError("--nvrx runs NVIDIA Resiliency Extension's ft_launcher, which is not installed here: "
                              f"pip install nvidia-resiliency-ext=={NVRX_VERSION} (its wheels need glibc >= 2.39; "
                              "the NGC image has it)")
        from nvidia_resiliency_ext.fault_tolerance import launcher

        chosen = Agent("NVRx ft_launcher", launcher.parse_args, launcher.config_from_args, launcher.run,
                       api.SimpleElasticAgent, launcher.LocalElasticAgent, api.WorkerState, processes,
                       ChildFailedError)
    else:
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        chosen = Agent("torchrun", torchrun.parse_args, torchrun.config_from_args, torchrun.run,
                       api.SimpleElasticAgent, LocalElasticAgent, api.WorkerState, processes, ChildFailedError)
    prepare(chosen)
    return chosen


def prepare(chosen: Agent) -> None:
    """The four changes of the module docstring (once per class: a second call changes nothing)."""
    _end_restarts_after_errors_a_restart_repeats(chosen)
    _report_the_failures_seen(chosen)
    _time_restarts(chosen.simple_agent)
    _stop_ranks_with_a_checkpoint_on_signals(chosen.processes)


def _end_restarts_after_errors_a_restart_repeats(chosen: Agent) -> None:
    monitor = chosen.local_agent._monitor_workers
    if getattr(monitor, "ends_restarts", False):
        return
    failed = (chosen.worker_state.FAILED, chosen.worker_state.UNHEALTHY)  # NVRx: some ranks failed, others run

    def monitor_workers(agent, worker_group):
        result = monitor(agent, worker_group)
        if result.state in failed and result.failures:
            agent.seen_failures = result.failures
            if any(failure.exitcode in NOT_RESTARTED for failure in result.failures.values()):
                agent._remaining_restarts = 0
        return result

    monitor_workers.ends_restarts = True
    chosen.local_agent._monitor_workers = monitor_workers


def _report_the_failures_seen(chosen: Agent) -> None:
    """NVRx 0.6.0's agent ends a run out of restarts with a FAILED result without the failures it saw (launcher.py,
    ``_invoke_run_with_any_failed_policy``), on which its launcher fails to build the ChildFailedError that names the
    failed rank (an AssertionError instead): the result gets the failures the monitor last saw back."""
    invoke_run = chosen.local_agent._invoke_run
    if getattr(invoke_run, "reports_failures", False):
        return

    def invoke_run_reporting_failures(agent, *args, **kwargs):
        result = invoke_run(agent, *args, **kwargs)
        if result.is_failed() and not result.failures and getattr(agent, "seen_failures", None):
            result = dataclasses.replace(result, failures=agent.seen_failures)
        return result

    invoke_run_reporting_failures.reports_failures = True
    chosen.local_agent._invoke_run = invoke_run_reporting_failures


def _time_restarts(simple_agent: type) -> None:
    if getattr(simple_agent._restart_workers, "timed", False):
        return
    restart_workers, initialize_workers, rendezvous = (simple_agent._restart_workers,
                                                       simple_agent._initialize_workers, simple_agent._rendezvous)

    def timed_restart(agent, worker_group):  # stops the workers, then initializes them (rendezvous, start)
        os.environ[RESTART_DECIDED_AT] = repr(time.time())
        return restart_workers(agent, worker_group)

    def timed_initialize(agent, worker_group):
        os.environ[WORKERS_STOPPED_AT] = repr(time.time())
        return initialize_workers(agent, worker_group)

    def timed_rendezvous(agent, worker_group):
        result = rendezvous(agent, worker_group)
        os.environ[RENDEZVOUS_DONE_AT] = repr(time.time())
        return result

    timed_restart.timed = True
    simple_agent._restart_workers, simple_agent._initialize_workers, simple_agent._rendezvous = (
        timed_restart, timed_initialize, timed_rendezvous)


def _stop_ranks_with_a_checkpoint_on_signals(processes: ModuleType) -> None:
    """The agent passes a signal it handles on to the ranks and kills them ``--shutdown-timeout`` seconds later
    (default 30): the ranks get SIGTERM for SIGINT too."""

    def raise_stop(signum: int, _frame) -> None:
        received = signal.Signals(signum)
        stop = processes.SignalException(f"Process {os.getpid()} got signal: {received.name}",
                                         sigval=signal.SIGTERM if received == signal.SIGINT else received)
        stop.received = received
        raise stop

    processes._terminate_process_handler = raise_stop  # what the agent installs when it starts the ranks

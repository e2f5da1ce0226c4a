"""The elastic agent that runs the ranks under ``recipes.launch``, and what this project changes in it.

Two agents: torchrun's, or NVIDIA Resiliency Extension's ``ft_launcher`` (``recipes.launch --nvrx``), a subclass of
torch's elastic agent that adds rank heartbeats watched from outside the ranks (:mod:`.nvrx`) and node health
checks. Both get the same seven changes (:func:`agent`): a subclass of the agent class, :class:`Changes`, which its
launcher builds in place of its own (the launcher module's one attribute replaced), and the signal handler torch
installs, a module function:

* a failure whose exit code a restart would repeat (NOT_RESTARTED: config/data/checkpoint errors, divergence) ends
  the job at once instead of using up ``--max-restarts``;
* after a fault that recurred in place (exit 16, :mod:`.reruns`), the agent of a node where it began leaves the job
  when a waiting node (a hot spare) can take its place or the job can go on without it (``--nnodes MIN:MAX``): the
  other agents restart their workers, and the step runs again on other GPUs without a requeue. When neither is
  possible, or that node hosts the rendezvous, every agent ends the job (the SLURM templates requeue it without the
  node) instead of restarting its workers where the fault recurs;
* a run that fails names the ranks that failed (NVRx 0.6.0 loses them when it runs out of restarts);
* a hot spare the job ended without raises :class:`SpareNotNeeded`, on which ``recipes.launch`` says so and exits
  0: torch 2.13's launcher fails it either way the end reaches it (an AttributeError when the closed rendezvous
  lets it go, as ``launch_agent`` reads the None its agent's graceful exit returns; the store's connection error when
  the host's agent exits first), and SLURM would count a failed task;
* the agent's environment, which the workers it starts inherit, records when it decided to restart them, had
  stopped the old ones and had the new world's rendezvous (:mod:`.elastic` says where a recovery went);
* where the agent keeps its rendezvous store to itself, its environment names that store and the round to the
  workers (:mod:`.job_store`): their failure reports and hang heartbeats must outlive rank 0, which hosts the ranks'
  own store there (a rank 0 stopped or gone would take the hang watchdog's heartbeats with it);
* SIGTERM or Ctrl-C to the launcher reaches the ranks as SIGTERM, on which they checkpoint at the next step boundary
  (SIGINT would interrupt them without a checkpoint); the exception remembers the signal received.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import time
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

from megatron_ext.distributed.store_keys import rerun_elsewhere_key
from megatron_ext.errors import EXIT_DIVERGED, EXIT_RERUN_ELSEWHERE, EXIT_STORAGE, EXIT_USER_ERROR, ConfigError
from megatron_ext.resilience.elastic import RENDEZVOUS_DONE_AT, RESTART_DECIDED_AT, WORKERS_STOPPED_AT
from megatron_ext.resilience.run_record import node_name

if TYPE_CHECKING:
    from megatron_ext.resilience.reruns import PendingRerun

# A restart would fail the same way: fix the config/data/checkpoint, or the run's numerics, first.
NOT_RESTARTED = (EXIT_USER_ERROR, EXIT_DIVERGED, EXIT_STORAGE)
NVRX_VERSION = "0.6.0"  # megatron-core 0.19 refuses to import beside an older NVRx; requirements-nvrx.txt pins it


@dataclasses.dataclass(frozen=True)
class Agent:
    """One agent implementation: its command line, its launch and its elastic agent class (this module's subclass)."""

    name: str
    parse_args: Callable[[list[str]], Any]
    run: Callable[[Any], None]
    local_agent: type  # the LocalElasticAgent subclass its launcher builds: :class:`Changes` over the original
    processes: ModuleType  # elastic.multiprocessing.api: the signal handler it installs, SignalException
    child_failed: type  # ChildFailedError


def agent(nvrx: bool) -> Agent:
    """torchrun's agent, or NVRx's ft_launcher (its ``--ft-*`` options then apply), prepared. NVRx >= 0.6's
    ft_launcher subclasses torch's elastic agent and uses torch's worker processes and errors, so both agents share
    those classes."""
    from torch.distributed.elastic.multiprocessing import api as processes
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if nvrx:
        if importlib.util.find_spec("nvidia_resiliency_ext") is None:
            raise ConfigError("--nvrx runs NVIDIA Resiliency Extension's ft_launcher, which is not installed here: "
                              f"pip install nvidia-resiliency-ext=={NVRX_VERSION} (its wheels need glibc >= 2.39; "
                              "the NGC image has it)")
        from nvidia_resiliency_ext.fault_tolerance import launcher

        chosen = Agent("NVRx ft_launcher", launcher.parse_args, launcher.run,
                       _changed(launcher, processes), processes, ChildFailedError)
    else:
        from torch.distributed import run as torchrun
        from torch.distributed.launcher import api as launcher

        chosen = Agent("torchrun", torchrun.parse_args, torchrun.run,
                       _changed(launcher, processes), processes, ChildFailedError)
    _stop_ranks_with_a_checkpoint_on_signals(processes)
    return chosen


def _changed(launcher: ModuleType, processes: ModuleType) -> type:
    """The launcher module's LocalElasticAgent, from now on this module's subclass of it (its ``launch_agent`` builds
    the agent by that name: the one module attribute replaced; once per process)."""
    original = launcher.LocalElasticAgent
    if issubclass(original, Changes):
        return original
    # __wrapped__: the original, for the upstream hash (tests/unit/test_upstream_patches.py)
    launcher.LocalElasticAgent = type(f"Recipe{original.__name__}", (Changes, original),
                                      {"processes": processes, "__wrapped__": original, "__module__": __name__})
    return launcher.LocalElasticAgent


class SpareNotNeeded(Exception):
    """This node's agent never trained in the job's last world, and the job has ended: `why` says how it waited."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class Changes:
    """The changes of the module docstring but the last, as overrides of torch's elastic agent's methods (each calls
    the agent's own first or after): mixed into torch's or NVRx's LocalElasticAgent by :func:`agent`."""

    processes: ModuleType
    seen_failures: Optional[dict] = None

    def _monitor_workers(self, worker_group):
        """After a failure a restart would repeat, no restart; after exit 16, what :func:`_after_a_fault_recurred`
        decides."""
        from torch.distributed.elastic.agent.server.api import WorkerState

        result = super()._monitor_workers(worker_group)
        # NVRx: UNHEALTHY when some ranks failed while others run
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            self.seen_failures = result.failures
            codes = {failure.exitcode for failure in result.failures.values()}
            if codes & set(NOT_RESTARTED):
                self._remaining_restarts = 0
            elif EXIT_RERUN_ELSEWHERE in codes and self._remaining_restarts > 0:
                _after_a_fault_recurred(self, worker_group, self.processes)
        return result

    def _invoke_run(self, *args, **kwargs):
        """NVRx 0.6.0's agent ends a run out of restarts with a FAILED result without the failures it saw
        (launcher.py, ``_invoke_run_with_any_failed_policy``), on which its launcher fails to build the
        ChildFailedError that names the failed rank (an AssertionError instead): the result gets them back."""
        result = super()._invoke_run(*args, **kwargs)
        if result.is_failed() and not result.failures and self.seen_failures:
            result = dataclasses.replace(result, failures=self.seen_failures)
        return result

    def run(self, *args, **kwargs):
        """The agent's run, where a hot spare the job ended without raises SpareNotNeeded."""
        from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousConnectionError

        try:
            result = super().run(*args, **kwargs)
        except (RendezvousClosedError, RendezvousConnectionError) as e:
            if self._worker_group.group_rank is not None:  # a node that trained, whose restart found the job gone
                raise
            # which of the two a waiting node sees is a race: the host's agent closes the rendezvous, then exits
            raise SpareNotNeeded("it arrived after the job's rendezvous had closed" if isinstance(
                e, RendezvousClosedError) else "it waited as a hot spare until the rendezvous host ended") from None
        if result is None:  # the agent's graceful exit: the rendezvous closed while this node was in its redundancy list
            raise SpareNotNeeded("it waited as a hot spare until the job ended")
        return result

    def _restart_workers(self, worker_group):  # stops the workers, then initializes them (rendezvous, start)
        os.environ[RESTART_DECIDED_AT] = repr(time.time())
        return super()._restart_workers(worker_group)

    def _initialize_workers(self, worker_group):
        os.environ[WORKERS_STOPPED_AT] = repr(time.time())
        return super()._initialize_workers(worker_group)

    def _rendezvous(self, worker_group):
        """The rendezvous, timed, and the job store it made named to the workers."""
        result = super()._rendezvous(worker_group)
        os.environ[RENDEZVOUS_DONE_AT] = repr(time.time())
        name_the_job_store(worker_group.spec.rdzv_handler)
        return result


def rendezvous_store(rdzv_handler):
    """The TCP store at the rendezvous endpoint (hosted by one agent) of a c10d rendezvous; None for others."""
    store = getattr(rdzv_handler, "_store", None)
    return store if hasattr(store, "port") else None


def name_the_job_store(handler) -> None:
    """Name the job store of the rendezvous `handler` just completed to the workers this agent starts (their
    environment), where the agent keeps its rendezvous store to itself; else let them keep their MASTER_ADDR store."""
    from megatron_ext.resilience.job_store import JOB_STORE

    store = rendezvous_store(handler)
    # the round the rendezvous just completed names this world, as torch's own key prefix does (a static
    # rendezvous, or NVRx's barrier one, has none: the ranks keep their MASTER_ADDR store)
    round_ = getattr(getattr(getattr(handler, "_state_holder", None), "state", None), "round", None)
    if handler.use_agent_store or round_ is None or store is None:
        os.environ.pop(JOB_STORE, None)
    else:
        os.environ[JOB_STORE] = f"{store.host}:{store.port}/{handler.get_run_id()}.{round_}"


def _stop_ranks_with_a_checkpoint_on_signals(processes: ModuleType) -> None:
    """The agent passes a signal it handles on to the ranks and kills them ``--shutdown-timeout`` seconds later
    (default 30): the ranks get SIGTERM for SIGINT too. torch installs a module function, not a method of the agent:
    it is replaced in its module (once per process)."""
    if getattr(processes._terminate_process_handler, "stops_with_a_checkpoint", False):
        return

    def raise_stop(signum: int, _frame) -> None:
        received = signal.Signals(signum)
        stop = processes.SignalException(f"Process {os.getpid()} got signal: {received.name}",
                                         sigval=signal.SIGTERM if received == signal.SIGINT else received)
        stop.received = received
        raise stop

    raise_stop.stops_with_a_checkpoint = True
    raise_stop.__wrapped__ = processes._terminate_process_handler  # torch's, for the upstream hash
    processes._terminate_process_handler = raise_stop  # what the agent installs when it starts the ranks


@dataclasses.dataclass
class RerunsElsewhere:
    """What the agent needs of the run to act on exit 16: where the step to re-run is recorded (checkpoint.save)
    and the fewest nodes the job trains on (``--nnodes MIN:``)."""

    save: Optional[str] = None
    min_nodes: int = 1


RERUNS_ELSEWHERE = RerunsElsewhere()  # recipes.launch fills it in once the recipe is read


@dataclasses.dataclass(frozen=True)
class NodeLeft:
    """This node's agent left the job after `pending`'s fault recurred on its GPU, with `waiting` nodes to take its
    place."""

    node: str
    pending: PendingRerun
    waiting: int

    def describe(self) -> str:
        instead = "a waiting node takes its place" if self.waiting else "the job goes on without it"
        return (f"node {self.node} left the job: iteration {self.pending.iteration}'s fault recurred in place on its "
                f"GPU ({self.pending.describe()}); {instead}, and the step runs again on other GPUs")
AfterFault = Literal["leave", "restart", "end"]
HOST_KEY_WAIT = timedelta(seconds=30)


def after_a_fault_recurred(node: str, suspects: list[str], host: Optional[str], nodes: int, min_nodes: int,
                           waiting: int) -> AfterFault:
    """What this node's agent does after every rank exited 16: the suspect nodes leave ("leave") and the others
    restart their workers ("restart") if the nodes left and those waiting to join (spares) still make a job of at
    least `min_nodes`, and the rendezvous host (`host`, None if unknown) is not a suspect; otherwise every agent ends
    the job ("end")."""
    left = nodes - len(set(suspects))
    if left < 1 or left + waiting < min_nodes or (host is not None and host in suspects):
        return "end"
    return "leave" if node in suspects else "restart"


def _waiting_nodes(rdzv_handler) -> int:
    """Agents waiting to join the next round: hot spares (torch's redundancy list, once the round is full) and nodes
    in its wait list. torch exposes only the wait list (``num_nodes_waiting``); the state it reads holds both. A
    static rendezvous has none."""
    holder = getattr(rdzv_handler, "_state_holder", None)
    if holder is None:
        return 0
    with rdzv_handler._heartbeat_lock:
        holder.sync()
        return len(holder.state.redundancy_list) + len(holder.state.wait_list)


def agreed(store, key: str, value: int) -> int:
    """`value`, unless another agent of the round put its own under `key` first: every agent decides on the first
    one's count, taken before any agent restarted its workers (a restarted agent waits in the list it counts)."""
    return int(store.compare_set(key, "", str(value)).decode())


def _rendezvous_host(worker_group, iteration: int) -> Optional[str]:
    """The node whose agent hosts the rendezvous store (it cannot leave without ending the job): that agent, the
    one listening on the store's port, says so in the round's store; None when no agent of this round hosts it (a
    waiting one may)."""
    import psutil
    from torch.distributed import DistStoreError

    store, key = worker_group.store, rerun_elsewhere_key(iteration, "host")
    rendezvous = rendezvous_store(worker_group.spec.rdzv_handler)
    if rendezvous is not None and any(c.status == psutil.CONN_LISTEN and c.laddr.port == rendezvous.port
                                      for c in psutil.Process().net_connections(kind="tcp")):
        store.set(key, node_name())
    try:
        store.wait([key], HOST_KEY_WAIT)
    except DistStoreError:
        return None
    return store.get(key).decode()


def _after_a_fault_recurred(agent, worker_group, processes: ModuleType) -> None:
    """Exit 16 on this node (every rank exits 16 together): restart as usual, end the job, or leave it (a
    SignalException, which is how torch's launcher lets an agent go without closing the rendezvous to the others)."""
    from megatron_ext.errors import RecipeError
    from megatron_ext.resilience.reruns import PendingRerun

    try:
        pending = PendingRerun.read(RERUNS_ELSEWHERE.save)
    except RecipeError:
        pending = None  # the ranks of the restart say what is wrong with it
    if pending is None:
        agent._remaining_restarts = 0
        return
    nodes = worker_group.group_world_size
    waiting = agreed(worker_group.store, rerun_elsewhere_key(pending.iteration, "waiting"),
                     _waiting_nodes(worker_group.spec.rdzv_handler))

    def decide(host: Optional[str]) -> AfterFault:
        return after_a_fault_recurred(node_name(), pending.nodes, host, nodes, RERUNS_ELSEWHERE.min_nodes, waiting)

    # every agent decides alike: the host's name is asked for only where the numbers allow going on
    action = decide(None)
    if action != "end":
        action = decide(_rendezvous_host(worker_group, pending.iteration))
    if action == "end":
        agent._remaining_restarts = 0
    elif action == "leave":
        leaves = processes.SignalException(f"node {node_name()} leaves the job", sigval=signal.SIGTERM)
        leaves.left = NodeLeft(node_name(), pending, waiting)
        raise leaves

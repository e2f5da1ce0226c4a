"""Launcher: ``python -m recipes.launch [torchrun options] --config X.yaml [section.key=value ...]``.

Checks the recipe once for the world size about to start (a config error is one line, before any rank exists;
so is a run already complete, or a checkpoint directory another run holds),
then runs torchrun's elastic agent in this process with ``-m recipes.pretrain``. A failed run ends with one line
naming the rank that failed first and its log instead of torchrun's traceback; the exit code is that rank's
(2 config/data/checkpoint, 3 divergence, 4 hang: see megatron_ext/errors.py), so SLURM scripts
can act on it. With ``--max-restarts`` the agent restarts failed workers, except after exit 2 or 3, which a restart
would repeat. SIGTERM or Ctrl-C to this launcher stops the run with a checkpoint at the next step boundary and one
line; the exit code is then 128 + the signal's number (143, 130).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time

from megatron_ext.config.schema import RecipeConfig, data_parallel_size, load_config, log_dir
from megatron_ext.errors import EXIT_DIVERGED, EXIT_FAILED, EXIT_PEER_FAILED, EXIT_USER_ERROR, ConfigError
from megatron_ext.resilience.elastic import RENDEZVOUS_DONE_AT, RESTART_DECIDED_AT, WORKERS_STOPPED_AT
from megatron_ext.resilience.failures import rank_log
from recipes.pretrain import fitting_world, import_problem, load_and_validate, nothing_to_do, planned_layout


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """torchrun's options, and the recipe's arguments (from ``--config`` on)."""
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            return argv[:i], argv[i:]
    raise SystemExit("usage: python -m recipes.launch [torchrun options] --config X.yaml [section.key=value ...]")


def _recipe_args(recipe_argv: list[str]) -> tuple[str, list[str]]:
    if recipe_argv[0].startswith("--config="):
        return recipe_argv[0].split("=", 1)[1], recipe_argv[1:]
    if len(recipe_argv) < 2:
        raise SystemExit("recipes.launch: --config needs a recipe YAML")
    return recipe_argv[1], recipe_argv[2:]


def _node_counts(args) -> tuple[range, int]:
    """(the node counts torchrun may start the job on, processes per node), from its own options."""
    from torch.distributed.run import config_from_args

    config, _, _ = config_from_args(args)
    return range(config.min_nodes, config.max_nodes + 1), config.nproc_per_node


def _elastic_overrides(config: str, overrides: list[str], world_size: int, per_node: int) -> list[str]:
    """What an elastic launch adds to the recipe for every world it may run on: a world the layout or global batch
    does not fit leaves ranks idle rather than failing (unless the recipe says otherwise), and parallel.auto plans
    once, for the largest world, so that TP × PP × CP stay fixed and only DP follows the world (a mid-run checkpoint
    reshards across DP)."""
    cfg = load_config(config, overrides)
    added = [] if any(o.startswith("parallel.allow_idle_ranks=") for o in overrides) else [
        "parallel.allow_idle_ranks=true"]
    if cfg.parallel.auto:
        added += [*planned_layout(cfg, world_size, per_node), "parallel.auto=false"]
    return added


def _elastic_worlds(cfg: RecipeConfig, nodes: range, per_node: int) -> str:
    """The line saying what each node count trains with; ConfigError naming the node count that cannot train."""
    said = []
    for n in nodes:
        try:
            world = fitting_world(cfg, n * per_node)
        except ConfigError as e:
            raise ConfigError(f"with {n} node{'s' * (n > 1)} ({n * per_node} processes) of --nnodes "
                              f"{nodes[0]}:{nodes[-1]}: {e}") from None
        idle = n * per_node - world.size
        said.append(f"{n} → DP {data_parallel_size(cfg, world.size)}" + (f" ({idle} idle)" if idle else ""))
    return f"elastic on {nodes[0]}-{nodes[-1]} nodes × {per_node} processes: " + ", ".join(said)


# The signals after which faulthandler has written the rank's stack (megatron_ext.resilience.failures)
_CRASHES = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT")


def _describe(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        why = (" (the kernel's out-of-memory killer, or kill -9)" if name == "SIGKILL" else
               " (a crash in native code: the rank's log holds its Python stack)" if name in _CRASHES else "")
        return f"was killed by {name}{why}"
    return f"exited with code {code}"


def _is_consequence(failure) -> bool:
    """A rank that stopped because a peer failed, or that torchrun ended after another rank failed."""
    return failure.exitcode in (EXIT_PEER_FAILED, -signal.SIGTERM)


def _root_cause(failures: dict) -> tuple[int, object]:
    """The rank that failed by itself: not one that stopped because a peer did, nor one torchrun then ended."""
    return min(failures.items(), key=lambda item: (_is_consequence(item[1]), item[1].timestamp, item[0]))


def _node() -> str:
    """This node's name as SLURM knows it (what ``--exclude`` takes), else its hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


# A restart would fail the same way: fix the config/data/checkpoint, or the run's numerics, first.
NOT_RESTARTED = (EXIT_USER_ERROR, EXIT_DIVERGED)


def _end_restarts_after_errors_a_restart_repeats() -> None:
    """torchrun's agent restarts its workers after any failure (``--max-restarts``, elastic runs); a failure
    with an exit code in NOT_RESTARTED ends the job at once instead, with the one-line summary."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers
    if getattr(monitor, "ends_restarts", False):
        return

    def monitor_workers(agent, worker_group):
        result = monitor(agent, worker_group)
        if result.state == WorkerState.FAILED and any(
                failure.exitcode in NOT_RESTARTED for failure in result.failures.values()):
            agent._remaining_restarts = 0
        return result

    monitor_workers.ends_restarts = True
    LocalElasticAgent._monitor_workers = monitor_workers


def _time_restarts() -> None:
    """Record in the agent's environment, which the workers it starts inherit, when it decided to restart them and
    when the new world's rendezvous was complete: a restarted run's first step says where its recovery went
    (megatron_ext.resilience.elastic)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    if getattr(SimpleElasticAgent._restart_workers, "timed", False):
        return
    agent = SimpleElasticAgent
    restart_workers, initialize_workers, rendezvous = (agent._restart_workers, agent._initialize_workers,
                                                       agent._rendezvous)

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
    agent._restart_workers, agent._initialize_workers, agent._rendezvous = (timed_restart, timed_initialize,
                                                                           timed_rendezvous)


def _stop_ranks_with_a_checkpoint_on_signals() -> None:
    """SIGTERM or Ctrl-C to this launcher: torchrun's agent passes the signal on to the ranks and kills them
    ``--shutdown-timeout`` seconds later (torchrun's default 30). A rank checkpoints on SIGTERM at its next step
    boundary and exits 0, but SIGINT would interrupt it without a checkpoint: the ranks get SIGTERM for both; the
    exception remembers which signal this launcher received."""
    from torch.distributed.elastic.multiprocessing import api

    def raise_stop(signum: int, _frame) -> None:
        received = signal.Signals(signum)
        stop = api.SignalException(f"Process {os.getpid()} got signal: {received.name}",
                                   sigval=signal.SIGTERM if received == signal.SIGINT else received)
        stop.received = received
        raise stop

    api._terminate_process_handler = raise_stop  # what torchrun's agent installs when it starts the ranks


def _stopped_by(received: signal.Signals, save: str | None) -> str:
    """The line after a stop on a signal: where the run can resume from, read from what the ranks left."""
    from megatron_ext.checkpoint.layout import iteration_dir, latest_iteration
    from megatron_ext.resilience.elastic import read_progress

    if save is None:
        return f"stopped by {received.name}: checkpoint.save is not set, nothing was saved"
    saved = latest_iteration(save)
    reached = read_progress(save)  # at most a second behind the last step
    if saved is not None and (reached is None or saved >= reached.iteration):
        return (f"stopped by {received.name} at iteration {saved}; checkpoint saved in {iteration_dir(save, saved)}; "
                "resume with the same command")
    newest = f"the newest checkpoint is iteration {saved}" if saved is not None else "there is no checkpoint"
    return (f"stopped by {received.name} after iteration {reached.iteration if reached else '?'}, but the ranks were "
            f"ended before they saved: {newest}; give them longer with --shutdown-timeout (seconds)")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's banner ("Setting OMP_NUM_THREADS ... to 1") and its per-failure lines and traceback, which repeat
    # what the failed rank said: the summary below replaces them. Errors of its own (rendezvous) still show.
    for name in ("torch.distributed.run", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.CRITICAL if name.endswith("elastic") else logging.ERROR)
    torchrun_argv, recipe_argv = _split(list(sys.argv[1:] if argv is None else argv))
    config, overrides = _recipe_args(recipe_argv)
    args = parse_args([*torchrun_argv, "-m", "recipes.pretrain", *recipe_argv])
    nodes, per_node = _node_counts(args)
    world_size, elastic = nodes[-1] * per_node, len(nodes) > 1
    if elastic:
        # torch 2.13's c10d rendezvous shares its TCPStore with the workers and keeps the store address of its first
        # round: a node that joins later waits for an address nobody writes (scale-up deadlocks). Unshared, every
        # round publishes its own, and rank 0 of each new world hosts that world's store.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        if elastic:
            added = _elastic_overrides(config, overrides, world_size, per_node)
            overrides += added
            args.training_script_args += added
        cfg, _ = load_and_validate(config, overrides, world_size, per_node)
        if elastic:
            print(_elastic_worlds(cfg, nodes, per_node), flush=True)
    except ImportError as e:
        print(import_problem(e), file=sys.stderr)
        return EXIT_USER_ERROR
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    # a node joining an elastic job (c10d rendezvous) finds the job's own lock on the checkpoints
    joins = args.rdzv_id if args.rdzv_backend != "static" and args.rdzv_id != "none" else None
    stop = nothing_to_do(cfg, check_lock=True, elastic_run_id=joins)
    if stop:
        print(stop[0], file=sys.stderr if stop[1] else sys.stdout, flush=True)
        return stop[1]
    _end_restarts_after_errors_a_restart_repeats()
    _time_restarts()
    _stop_ranks_with_a_checkpoint_on_signals()
    try:
        run(args)
    except SignalException as e:
        received = getattr(e, "received", e.sigval)
        print(_stopped_by(received, cfg.checkpoint.save), file=sys.stderr, flush=True)
        return 128 + int(received)
    except ChildFailedError as e:
        rank, failure = _root_cause(e.failures)
        others = len(e.failures) - 1
        # "failed" names the node whose rank failed by itself (the SLURM templates leave it out of a requeue);
        # "stopped" a node whose ranks only followed a failure elsewhere
        verb = "stopped" if _is_consequence(failure) else "failed"
        print(f"training {verb}: rank {rank} on {_node()} {_describe(failure.exitcode)} first"
              + (f" ({others} other rank{'s' if others > 1 else ''} stopped with it)" if others else "")
              + f"; its log: {rank_log(log_dir(cfg), rank)}", file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())

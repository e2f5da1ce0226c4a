"""Launcher: ``python -m recipes.launch [torchrun options] --config X.yaml [section.key=value ...]``.

Checks the recipe once for the world size about to start (a config error is one line, before any rank exists;
so is a run already complete, or a checkpoint directory another run holds),
then runs torchrun's elastic agent in this process with ``-m recipes.pretrain``. A failed run ends with one line
naming the rank that failed first and its log instead of torchrun's traceback; the exit code is that rank's
(2 config/data/checkpoint, 3 divergence, 4 hang: see megatron_ext/errors.py), so SLURM scripts
can act on it. With ``--max-restarts`` the agent restarts failed workers, except after exit 2 or 3, which a restart
would repeat; after exit 16 (a fault that recurred in place) the node where it began leaves when a waiting node or
``--nnodes MIN:MAX`` lets the job go on without it (megatron_ext/resilience/agent.py); a hot spare the job ended
without says so and exits 0. SIGTERM or Ctrl-C to this
launcher stops the run with a checkpoint at the next step boundary and one line; the exit code is then 128 + the
signal's number (143, 130). ``--nvrx`` runs NVIDIA Resiliency Extension's ft_launcher instead of torchrun's agent
(megatron_ext/resilience/agent.py): the ranks send it heartbeats, its ``--ft-*`` options apply.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from megatron_ext.config.schema import RecipeConfig, data_parallel_size, load_config, log_dir
from megatron_ext.errors import (
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_PEER_FAILED,
    EXIT_RERUN_ELSEWHERE,
    EXIT_USER_ERROR,
    ConfigError,
    signal_exit_code,
)
from megatron_ext.resilience.agent import RERUNS_ELSEWHERE, SpareNotNeeded, agent
from megatron_ext.resilience.failures import rank_log, writable_log_dir
from megatron_ext.resilience.run_record import NodeRecord, forget, node_name, node_record_path, write_node_end
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
    """(the node counts the agent may start the job on, processes per node), from its options (NVRx's launcher takes
    torchrun's) as torchrun reads them; its config_from_args would also make a log directory the run does not use."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    return range(min_nodes, max_nodes + 1), determine_local_world_size(args.nproc_per_node)


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


def joins_later(args) -> bool:
    """Whether a node may join this job after its first rendezvous round: any multi-node c10d rendezvous, where a hot
    spare waits in torch's redundancy list even at a fixed node count."""
    return args.rdzv_backend == "c10d" and not args.standalone


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
    if code == EXIT_RERUN_ELSEWHERE:
        return f"exited with code {code} (a fault recurred in place: resume on other GPUs)"
    return f"exited with code {code}"


def _is_consequence(failure, hung: bool = False) -> bool:
    """A rank that stopped because a peer failed, or that torchrun ended after another rank failed — with SIGKILL too
    when the hang watchdog ended the job (`hung`): the stuck rank cannot act on torchrun's SIGTERM, so it is killed,
    and the watchdog's line has already named it."""
    return failure.exitcode in (EXIT_PEER_FAILED, -signal.SIGTERM) or (hung and failure.exitcode == -signal.SIGKILL)


def _root_cause(failures: dict) -> tuple[int, object]:
    """The rank that failed by itself: not one that stopped because a peer did, nor one torchrun then ended."""
    hung = any(failure.exitcode == EXIT_HUNG for failure in failures.values())
    return min(failures.items(), key=lambda item: (_is_consequence(item[1], hung), item[1].timestamp, item[0]))


def _stopped_by(received: signal.Signals, save: str | None, stop_s: float) -> str:
    """The line after a stop on a signal: where the run can resume from, read from what the ranks left; when they
    were ended before they saved, the --shutdown-timeout a stop needs by the plan (`stop_s`). torchrun's default (30
    s) is not raised to it by itself: the agent waits as long for ranks stuck in a collective after a failure."""
    from megatron_ext.checkpoint.layout import iteration_dir, latest_iteration, progress_path
    from megatron_ext.resilience.elastic import read_progress

    if save is None:
        return f"stopped by {received.name}: checkpoint.save is not set, nothing was saved"
    saved = latest_iteration(save)
    reached = read_progress(progress_path(save))  # at most a second behind the last step
    if saved is not None and (reached is None or saved >= reached.iteration):
        return (f"stopped by {received.name} at iteration {saved}; checkpoint saved in {iteration_dir(save, saved)}; "
                "resume with the same command")
    newest = f"the newest checkpoint is iteration {saved}" if saved is not None else "there is no checkpoint"
    return (f"stopped by {received.name} after iteration {reached.iteration if reached else '?'}, but the ranks were "
            f"ended before they saved: {newest}; give them longer: --shutdown-timeout={stop_s:.0f} (the planned "
            "seconds to the next logging step and through a checkpoint write)")


def main(argv: list[str] | None = None, entry: str = "recipes.pretrain") -> int:
    """`entry`: the ranks' module (a wrapper of recipes.pretrain's entry point, as the tests' fault injectors are)."""
    torchrun_argv, recipe_argv = _split(list(sys.argv[1:] if argv is None else argv))
    nvrx = "--nvrx" in torchrun_argv
    torchrun_argv = [arg for arg in torchrun_argv if arg != "--nvrx"]
    try:
        chosen = agent(nvrx)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    # the agent's banner ("Setting OMP_NUM_THREADS ... to 1") and its per-failure lines and traceback, which repeat
    # what the failed rank said: the summary below replaces them. Errors of its own (rendezvous) still show.
    for name, level in (("torch.distributed.run", logging.ERROR), ("torch.distributed.elastic", logging.CRITICAL),
                        ("nvidia_resiliency_ext", logging.ERROR)):
        logging.getLogger(name).setLevel(level)
    config, overrides = _recipe_args(recipe_argv)
    args = chosen.parse_args([*torchrun_argv, "-m", entry, *recipe_argv])
    nodes, per_node = _node_counts(args)
    world_size, elastic = nodes[-1] * per_node, len(nodes) > 1
    if joins_later(args):
        # torch 2.13's c10d rendezvous shares its TCPStore with the workers and keeps the store address of its first
        # round: a node that joins later (a scale-up, or a hot spare at --nnodes N:N) waits for an address nobody
        # writes, and the round deadlocks. Unshared, every round publishes its own, and rank 0 of each new world hosts
        # that world's store.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        if elastic:
            added = _elastic_overrides(config, overrides, world_size, per_node)
            overrides += added
            args.training_script_args += added
        cfg, _, timeouts = load_and_validate(config, overrides, world_size, per_node, say_timeouts=False)
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
    if args.log_dir is None:  # torch's agent would leave a directory of its per-rank error files in /tmp per launch
        args.log_dir = str(writable_log_dir(log_dir(cfg)) / "agent")
    node = node_name()
    forget(node_record_path(log_dir(cfg), node))
    RERUNS_ELSEWHERE.save, RERUNS_ELSEWHERE.min_nodes = cfg.checkpoint.save, nodes[0]
    try:
        chosen.run(args)
    except SpareNotNeeded as e:
        print(f"node {node} was not needed: {e.why}; the other nodes' lines say how the job ended", flush=True)
        write_node_end(log_dir(cfg), NodeRecord(node, "not needed", 0))
        return 0
    except chosen.processes.SignalException as e:
        if hasattr(e, "left"):
            print(e.left.describe(), file=sys.stderr, flush=True)
            write_node_end(log_dir(cfg), NodeRecord(node, "left", EXIT_RERUN_ELSEWHERE))
            # leaving, the agent keeps the rendezvous open to the others: torch's keep-alive and store threads still
            # run, and the interpreter's teardown under them aborts (SIGABRT, "terminate called without an active
            # exception", seen in the suite): the node's end is recorded, so end the process here
            sys.stdout.flush()
            os._exit(EXIT_RERUN_ELSEWHERE)
        received = getattr(e, "received", e.sigval)
        print(_stopped_by(received, cfg.checkpoint.save, timeouts.stop_s), file=sys.stderr, flush=True)
        write_node_end(log_dir(cfg), NodeRecord(node, "signalled", signal_exit_code(received)))
        return signal_exit_code(received)
    except chosen.child_failed as e:
        rank, failure = _root_cause(e.failures)
        others = len(e.failures) - 1
        # "failed": a rank of this node failed by itself (the SLURM templates leave the node out of a requeue);
        # "stopped": this node's ranks only followed a failure elsewhere
        followed = _is_consequence(failure)
        print(f"training {'stopped' if followed else 'failed'}: rank {rank} on {node} {_describe(failure.exitcode)} "
              "first" + (f" ({others} other rank{'s' if others > 1 else ''} stopped with it)" if others else "")
              + f"; its log: {rank_log(log_dir(cfg), rank)}", file=sys.stderr, flush=True)
        code = failure.exitcode if failure.exitcode > 0 else EXIT_FAILED
        write_node_end(log_dir(cfg), NodeRecord(node, "followed" if followed else "failed", code,
                                                None if followed else rank))
        return code
    write_node_end(log_dir(cfg), NodeRecord(node, "finished", 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())

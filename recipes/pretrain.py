"""Entry point: ``torchrun --nproc-per-node N -m recipes.pretrain --config configs/X.yaml [section.key=value ...]``."""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING

from megatron_ext.config.paths import refuse_unmounted_paths
from megatron_ext.config.schema import (
    AUTO,
    COLLECTIVE_TIMEOUT_FLOOR_MINUTES,
    HANG_TIMEOUT_FLOOR_S,
    RecipeConfig,
    data_parallel_size,
    keys_table,
    load_config,
    log_dir,
)
from megatron_ext.config.validate import TrainedWorld, trained_world
from megatron_ext.errors import EXIT_USER_ERROR, ConfigError
from megatron_ext.metrics.run_logger import perplexity, remove_wandb_import_temp_dirs
from megatron_ext.resilience.failures import fatal_signal_stacks_logged
from megatron_ext.resilience.process_guard import guard_training_rank
from megatron_ext.resilience.run_record import (
    TrainingRecord,
    forget,
    training_record_path,
    write_training_end,
)

if TYPE_CHECKING:
    from megatron_ext.planner.timeouts import Timeouts


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
    for noisy in ("megatron", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Its lines are the state machine's internals; megatron_ext.resilience.reruns says what it found, once
    logging.getLogger("megatron.core.rerun_state_machine").setLevel(logging.CRITICAL)


def _summary(cfg, result) -> str:
    lines = ["", "=" * 72, f"run {cfg.recipe.name}: finished at iteration {result.iteration}"
             + (" (stopped early; launching it again resumes)" if result.stopped_early else "")]
    if result.train_losses:
        first_step, last_step = min(result.train_losses), max(result.train_losses)
        lines.append(f"  train loss: {result.train_losses[first_step]:.4f} (step {first_step}) -> "
                     f"{result.train_losses[last_step]:.4f} (step {last_step})")
    if result.val_losses:
        step = max(result.val_losses)
        lines.append(f"  validation loss: {result.val_losses[step]:.4f} (step {step})")
    if result.test_loss is not None:
        lines.append(f"  test loss: {result.test_loss:.4f} (perplexity {perplexity(result.test_loss):,.2f})")
    if result.startup:
        lines.append(f"  start-up: {result.startup}")
    if result.goodput:
        lines.append(f"  {result.goodput.summary()}")
    if len(result.step_times) > 1:
        lines.append(f"  step time: median {statistics.median(result.step_times[1:]) * 1000:.0f} ms "
                     f"(first step {result.step_times[0] * 1000:.0f} ms)")
    lines += [f"  {line}" for line in result.plan_check]
    if result.checkpoint:
        lines.append(f"  checkpoint: {result.checkpoint}")
    if cfg.logging.tensorboard_dir:
        lines.append(f"  TensorBoard: tensorboard --logdir {cfg.logging.tensorboard_dir}")
    lines.append("=" * 72)
    return "\n".join(lines)


def _exit_now(code: int) -> None:
    """A rank ends without the interpreter's teardown (1-2 s of CPU per rank here: megatron-core's modules, and
    joining the checkpoint save helpers, which end by themselves with their parent): a finished job's allocation is
    free that much sooner, torchrun's agent restarts failed workers that much sooner, and the peers of a rank that
    ends on its launcher's death see its sockets close that much sooner. Nothing is left to write by then: the
    trainer has closed the checkpoints, TensorBoard, W&B and the rank monitor, on success and on failure alike;
    what was logged is flushed here, and the temporary directories the teardown would have removed are removed."""
    remove_wandb_import_temp_dirs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# How long the other ranks wait for rank 0 to say why they all stop: generous for ranks that start together
RANK_0_GRACE_S = 5.0


def _rank_0_says(rank: int, message: str, exit_code: int) -> int:
    """A verdict every rank reaches alike before any process group exists (recipes.launch reaches it before starting
    any rank): rank 0 says it, once for the job. Under plain torchrun the first rank to end with an error has the
    agent stop the others, so on an error the others end a few seconds later, when rank 0 has said it."""
    if rank == 0:
        print(message, file=sys.stderr if exit_code else sys.stdout, flush=True)
    elif exit_code:
        time.sleep(RANK_0_GRACE_S)
    return exit_code


def _startup_clock():
    """The start-up timer, from the launcher's start on a first start by an elastic agent (to this process's start:
    the phase "launcher"), else from this process's start; what came before main() is the imports."""
    from megatron_ext.metrics.run_logger import StartupClock, launcher_start_time, process_start_time

    launched, started = launcher_start_time(), process_start_time()
    clock = StartupClock(started if launched is None else min(launched, started))
    if launched is not None:
        clock.mark("launcher", at=started)
    clock.mark("imports")
    return clock


def planned_layout(cfg: RecipeConfig, world_size: int, gpus_per_node: int) -> list[str]:
    """parallel.auto=true: the planner's best layout for this world size, as overrides."""
    from megatron_ext.planner import best_layout, detect_gpu

    gpu = cfg.parallel.auto_gpu or detect_gpu()
    chosen = best_layout(cfg, world_size, gpus_per_node, gpu)
    planned = [f"{key}={'null' if value is None else value}" for key, value in chosen.items()]
    if int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("megatron_ext").info(
            f"parallel.auto: planner's best layout on {world_size}× {gpu}: {' '.join(planned)}")
    return planned


def _skip_wandb_unless_logging_to_it(cfg: RecipeConfig) -> None:
    """megatron-core imports W&B wherever it is installed (its timers and inference modules, behind ``try: import
    wandb``), 0.5 s of CPU per rank here, whether or not the run logs to it: a run that does not is started as if W&B
    were not installed (Python's documented way: None in ``sys.modules``), before megatron-core is imported."""
    if not cfg.logging.wandb_project:
        sys.modules.setdefault("wandb", None)


def load_and_validate(config: str, overrides: list[str], world_size: int, gpus_per_node: int,
                      say_timeouts: bool) -> tuple[RecipeConfig, TrainedWorld, Timeouts]:
    """The recipe as the ranks will run it (with parallel.auto's layout and the timeouts its plan derives), checked
    for `world_size` processes, which of them train (all, unless parallel.allow_idle_ranks had to leave some idle),
    and its timeouts (logged where `say_timeouts`). Raises ConfigError; ImportError when megatron-core cannot be
    imported here."""
    cfg = load_config(config, overrides)
    _skip_wandb_unless_logging_to_it(cfg)
    from megatron_ext.checkpoint.storage_checks import validate_checkpoint_storage
    from megatron_ext.data.checks import validate_data

    if cfg.parallel.auto:
        overrides = [*overrides, *planned_layout(cfg, world_size, gpus_per_node)]
        cfg = load_config(config, overrides)
    world = fitting_world(cfg, world_size)
    refuse_unmounted_paths(cfg)  # under pyxis: before the data checks, which would only say "does not exist"
    validate_data(cfg)
    validate_checkpoint_storage(cfg)
    timeouts = run_timeouts(cfg, world.size, gpus_per_node, say_timeouts)
    if AUTO in (cfg.train.hang_timeout_s, cfg.parallel.distributed_timeout_minutes):
        cfg = load_config(config, [*overrides, *timeouts.overrides()])
    return cfg, world, timeouts


def run_timeouts(cfg: RecipeConfig, world_size: int, gpus_per_node: int, say: bool) -> Timeouts:
    """The run's timeouts from its plan on this machine's GPU (an H100's where the planner has no entry: slower GPUs
    are rarer than newer ones). With `say`, logs them where the plan lengthened them, what a timeout the config
    sets risks, and a checkpoint.save_interval that costs expected goodput (metrics.advice)."""
    from megatron_ext.metrics.advice import checkpoint_interval_advice
    from megatron_ext.planner import model_vocab_size, planner_gpu
    from megatron_ext.planner.goodput import recipe_checkpoint_interval
    from megatron_ext.planner.timeouts import planned_timeouts, timeout_warnings

    gpu = planner_gpu(cfg) or "h100-80gb"
    vocab = model_vocab_size(cfg)
    timeouts = planned_timeouts(cfg, world_size, gpus_per_node, gpu, vocab_size=vocab)
    if say:
        log = logging.getLogger("megatron_ext")
        lengthened = ((cfg.train.hang_timeout_s == AUTO and timeouts.hang_s != HANG_TIMEOUT_FLOOR_S)
                      or (cfg.parallel.distributed_timeout_minutes == AUTO
                          and timeouts.collective_minutes != COLLECTIVE_TIMEOUT_FLOOR_MINUTES))
        if lengthened:
            log.info(f"timeouts on {world_size}× {gpu}: {timeouts.describe()}")
        for warning in timeout_warnings(timeouts, under_slurm="SLURM_JOB_ID" in os.environ):
            log.warning(warning)
        if cfg.checkpoint.save:
            interval = recipe_checkpoint_interval(cfg, world_size, timeouts.step_s, vocab)
            advice = checkpoint_interval_advice(interval, cfg.train.train_iters)
            if advice:
                log.info(f"advice: {advice}")
    return timeouts


def fitting_world(cfg: RecipeConfig, world_size: int) -> TrainedWorld:
    """:func:`trained_world` with what this machine has (a GPU and its compute capability, TransformerEngine), after
    the kernels and offloads it cannot run are refused."""
    import torch

    from megatron_ext.config.kernels import refuse_what_this_machine_cannot_run
    from megatron_ext.model.llama import gpu_compute_capability, transformer_engine_available

    te_available = transformer_engine_available()
    refuse_what_this_machine_cannot_run(cfg, torch.cuda.is_available(), te_available)
    return trained_world(cfg, world_size, te_available=te_available, compute_capability=gpu_compute_capability())


def idle_ranks_line(world_size: int, world: TrainedWorld, cfg: RecipeConfig) -> str:
    """What rank 0 says when some ranks of a started world stay idle."""
    idle = (f"rank {world.size} stays idle and exits" if world.size == world_size - 1 else
            f"ranks {world.size}-{world_size - 1} stay idle and exit")
    return (f"world {world_size} does not fit ({world.idle_because}): {world.size} ranks train "
            f"(DP {data_parallel_size(cfg, world.size)}), {idle}")


def nothing_to_do(cfg, check_lock: bool, elastic_run_id: str | None = None) -> tuple[str, int] | None:
    """(line, exit code) for a launch that must not start ranks: its run is already complete (0), its checkpoint
    was written with(out) Megatron-FSDP and this run is not (2), or (with `check_lock`, the launcher's check: a rank
    would see its own job's lock) another run holds its checkpoint directory (2) — not the elastic job
    `elastic_run_id` this launch joins. Read from the checkpoint directory alone, in well under a second."""
    from megatron_ext.checkpoint.resume import finished_run, format_refusal
    from megatron_ext.checkpoint.run_lock import holder_of

    done = finished_run(cfg)
    if done:
        return done, 0
    refusal = format_refusal(cfg)
    if refusal:
        return f"checkpoint error: {refusal}", EXIT_USER_ERROR
    held = holder_of(cfg.checkpoint.save, elastic_run_id) if check_lock and cfg.checkpoint.save else None
    return (f"checkpoint error: {held}", EXIT_USER_ERROR) if held else None


def import_problem(e: ImportError) -> str:
    """The one line for a megatron-core that cannot be imported (usually a broken TransformerEngine)."""
    return (f"error: megatron-core cannot be imported here: {e}"
            + (" — TransformerEngine is installed but incomplete or broken; reinstall it, or uninstall it to "
               "train with megatron-core's local layers (python -m recipes.doctor checks the result)"
               if "transformer_engine" in str(e) else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.pretrain", description=__doc__)
    parser.add_argument("--config", help="recipe YAML, e.g. configs/tiny.yaml")
    parser.add_argument("--list-keys", action="store_true",
                        help="print every config key with its type, default and help (Markdown), and exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.train_iters=20")
    args = parser.parse_args(argv)
    if args.list_keys:
        print(keys_table(), end="")
        return 0
    if args.config is None:
        parser.error("--config is required")
    orphan_guard_missing = guard_training_rank()  # first: a launcher may die while this rank still imports
    startup = _startup_clock()
    _setup_logging()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if orphan_guard_missing and rank == 0:
        logging.getLogger("megatron_ext").warning(f"ranks will not stop with their launcher: {orphan_guard_missing}")
    try:
        cfg, world, _ = load_and_validate(args.config, args.overrides, world_size,
                                          int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), say_timeouts=rank == 0)
    except ImportError as e:  # megatron-core imports TE at import time wherever `import transformer_engine` works
        return _rank_0_says(rank, import_problem(e), EXIT_USER_ERROR)
    except ConfigError as e:
        return _rank_0_says(rank, f"config error: {e}", EXIT_USER_ERROR)

    if world.size < world_size:
        if rank == 0:
            logging.getLogger("megatron_ext").info(idle_ranks_line(world_size, world, cfg))
        if rank >= world.size:
            return 0
        os.environ["WORLD_SIZE"] = str(world.size)  # the process group of the ranks that train
    stop = nothing_to_do(cfg, check_lock=False)  # the lock is taken collectively, in the run's checkpoint manager
    if stop:
        return _rank_0_says(rank, *stop)
    startup.mark("megatron-core imports, config and data checks")

    from megatron_ext.training.trainer import RunFailed, pretrain

    if rank == 0:
        forget(training_record_path(log_dir(cfg)))
    try:
        with fatal_signal_stacks_logged(log_dir(cfg), rank):
            result = pretrain(cfg, startup)
    except RunFailed as e:  # already said once for the job, traceback in the rank's log
        _exit_now(e.exit_code)
    # One summary per run: under torchrun's agent a signal stop is a membership change (the agent restarts the
    # workers) or the launcher's stop (its last line says where to resume)
    if rank == 0:
        ended = "exit signal" if result.stopped_by_signal else "exit interval" if result.stopped_early else "finished"
        write_training_end(log_dir(cfg), TrainingRecord(ended, result.iteration, result.goodput.seconds))
        if not (result.stopped_by_signal and "TORCHELASTIC_RUN_ID" in os.environ):
            print(_summary(cfg, result), flush=True)
    return 0


def entry_point() -> None:
    """``python -m recipes.pretrain``: :func:`main`, then out without the interpreter's teardown (:func:`_exit_now`);
    also the entry point of the test workers that patch the trainer first."""
    _exit_now(main())


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    entry_point()

"""``python -m jodpo.train --config tldr.py [--FIELD VALUE ...] [--config.FIELD=VALUE ...]``: the training command.

It reads the config and the command line, sets up XLA and joins a multi-process job, then runs the training
program (``jodpo.program.loop.train``) and turns what ends it into one line and an exit code.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax

from jodpo.errors import (BackendError, CheckpointError, ConfigError, DataError, Diverged, HubError,  # noqa: F401
                          SaveError, Stopped)
from jodpo.program import aborts, backend
from jodpo.program import flags as F
from jodpo.program.config import FIELDS, TrainConfig
from jodpo.program import loop


def parse_args(argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    """The config (the recipe, then TRL's ``--FIELD VALUE`` flags, then ``--config.FIELD=VALUE``) and the command's
    own flags (``notes``: lines to show, from ``flags.with_overrides``). Mistakes are ``ConfigError``s."""
    parser = F.Parser(prog="python -m jodpo.train", description="Online DPO (and DPO) in JAX.",
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog="Every field is also --config.FIELD=VALUE (a Python literal). docs/config.md lists them, "
                             "and answers each of TRL's other fields, which are taken too.")
    parser.add_argument("--config", help="the recipe: a Python config file, a YAML file of TRL field names, or a "
                                          "bundled config by name (tiny.py, tldr.py, ...); without it every field "
                                          "starts at its TRL default")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--allow_config_change", action="store_true",
                        help="resume an output_dir whose saved config.json differs from this config")
    group = parser.add_argument_group("multi-process runs (docs/tpu.md)")
    group.add_argument("--distributed", action="store_true",
                       help="call jax.distributed.initialize() and let it find the cluster (Cloud TPU, SLURM, MPI); "
                            "automatic when SLURM or Open MPI runs more than one task")
    group.add_argument("--coordinator_address", help="host:port of process 0, for any other cluster")
    group.add_argument("--num_processes", type=int, help="processes in the job (with --coordinator_address)")
    group.add_argument("--process_id", type=int, help="this process's index, 0 .. num_processes-1")
    F.add_field_flags(parser, FIELDS, "fields (TRL's names: --FIELD VALUE, or --config.FIELD=VALUE)")
    F.add_trl_flags(parser)
    args, rest = parser.parse_known_args(argv)
    overrides = F.given_fields(args, FIELDS) | F.given_trl_fields(args) | F.dotted_overrides(rest)
    cfg, note = F.with_overrides(F.load_recipe(args.config), overrides)
    args.notes = [note] if note else []
    return cfg, args


def init_distributed(args: argparse.Namespace) -> None:
    """Join a multi-process job before anything touches the devices: explicitly from the three flags, or
    by JAX's own cluster detection with --distributed or under a multi-task SLURM / Open MPI launch."""
    explicit = (args.coordinator_address, args.num_processes, args.process_id)
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise ConfigError("--coordinator_address, --num_processes and --process_id go together; give all three")
        if not 0 <= args.process_id < args.num_processes:
            raise ConfigError(f"--process_id must be in 0..{args.num_processes - 1}, got {args.process_id}")
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    elif args.distributed or int(os.environ.get("SLURM_NTASKS", "1")) > 1 or \
            int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()


def main(argv: list[str] | None = None) -> int:
    backend.start_command()
    backend.one_line_warnings("jodpo.train")
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        cfg, args = parse_args(argv)
        backend.configure(cfg)  # XLA flags (determinism) before anything can start jax's backends
        init_distributed(args)
        said = backend.prepare(cfg)  # the rest of the set-up every way in gets (loop.train calls it too)
        if jax.process_index() == 0:
            for line in [*args.notes, *said]:
                print(f"jodpo.train: {line}", file=sys.stderr if line.startswith("warning") else sys.stdout,
                      flush=True)
        # the program (OnlineDPOTrainer.train's, without its TrainerState); the end pushed as TRL's scripts push it
        loop.train(cfg, args.allow_config_change, push_at_end=True)
    except Stopped as e:
        print(f"jodpo.train: {e}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:  # a second Ctrl-C (Interrupted), or one before the loop started
        print("jodpo.train: interrupted: stopped at once; a checkpoint being written was abandoned (the complete ones "
              "are kept): run the same command to resume from the newest", file=sys.stderr)
        return INTERRUPTED
    except (SaveError, Diverged, HubError) as e:
        if debug:
            raise
        print(f"jodpo.train: error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, DataError, CheckpointError, ValueError, FileNotFoundError) as e:  # BackendError too
        if debug:
            raise
        print(f"jodpo.train: error: {e}", file=sys.stderr)
        return 2
    return 0


INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that Ctrl-C ended


# After XLA's fatal log, the line that says what it means for the run (jodpo.program.aborts). Only where this module
# is the process (python -m jodpo.train), never where a script or a test calls main().
FATAL_SIGNAL = ("jodpo.train: the process was ended by a fatal signal ({signal}): {cause}. The checkpoints already "
                "saved are intact: run the same command to resume from the newest (docs/troubleshooting.md)")


if __name__ == "__main__":
    aborts.explain_fatal_signals(FATAL_SIGNAL)
    code = main()
    if code == INTERRUPTED:  # end now: the interpreter's exit would wait for (or tear down mid-write) Orbax's threads
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

"""The command line: parse key=value arguments, set up output and exit codes, and call one function per command.

No training logic lives here. A UserError becomes exit code 2 and one line on stderr, a diverged run exit code 3;
--verbose or YOLOACCUM_DEBUG=1 shows the traceback above that line. Anything else is a bug and raises.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from yoloaccum import __version__, api
from yoloaccum.config import settings as config
from yoloaccum.errors import Diverged, RanksFailed, UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Gradient-accumulating trainer for YOLO detectors. Arguments are key=value, as in Ultralytics.",
)
# click's error class, which typer raises for an unknown option or command; found through typer's public BadParameter,
# since newer typer releases carry their own copy of click and older ones import click itself
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
ARGS = Annotated[list[str] | None, typer.Argument(help="key=value settings, e.g. data=coco.yaml batch=8 nbs=64")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"yoloaccum {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show tracebacks for errors (anywhere).")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """Gradient-accumulating trainer for YOLO detectors. --verbose is read in run(), wherever it appears."""


@app.command()
def train(args: ARGS = None) -> None:
    """Train a detector with gradient accumulation, e.g. `yoloaccum train data=coco.yaml batch=8 nbs=64`; add
    callbacks=file.py to run the functions of that file named after Ultralytics' events (on_fit_epoch_end, ...)."""
    args = list(args or [])
    callbacks = _pop(args, "callbacks")
    api.train(callbacks=callbacks or None, **config.parse_args(args))


@app.command()
def val(args: ARGS = None) -> None:
    """Validate weights on a dataset, e.g. `yoloaccum val model=runs/train/exp/weights/best.pt data=coco.yaml`."""
    api.val(**config.parse_args(args or []))


@app.command()
def predict(args: ARGS = None) -> None:
    """Detect objects in an image or folder, e.g. `yoloaccum predict model=best.pt source=images/`."""
    api.predict(**config.parse_args(args or []))


@app.command()
def plan(
    args: ARGS = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary and every iteration as JSON.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw accumulate, lr and momentum into a PNG.")] = None,
) -> None:
    """Show what a recipe will do: accumulate, effective batch, weight decay, warmup ramp, steps. Add images=N
    to skip counting the dataset."""
    args = list(args or [])
    images = _pop(args, "images")
    if images is not None and not images.isdigit():
        raise UserError(f"images={images} must be a positive whole number")
    api.plan(images=int(images) if images is not None else None, as_json=as_json, plot=plot, **config.parse_args(args))


@app.command("cfg")
def show_cfg(args: ARGS = None) -> None:
    """Print the resolved configuration as YAML, e.g. `yoloaccum cfg cfg=recipe.yaml batch=8`."""
    cfg = config.resolve(args or [])
    if note := config.dropped_note(cfg):
        typer.echo(note, err=True)
    typer.echo(cfg.to_yaml(), nl=False)


@app.command()
def shapes(args: ARGS = None) -> None:
    """Generate the synthetic shapes dataset, e.g. `yoloaccum shapes out=datasets/shapes`."""
    from yoloaccum.data import shapes as shapes_

    args = list(args or [])
    out = _pop(args, "out") or "datasets/shapes"
    options = {}
    for key in ("num_train", "num_val", "imgsz", "seed"):
        if (value := _pop(args, key)) is not None:
            if not value.isdigit():
                raise UserError(f"{key}={value} must be a whole number")
            options[key] = int(value)
    if args:
        raise UserError(f"shapes takes out=, num_train=, num_val=, imgsz= and seed=, not {args[0]}")
    root = shapes_.ensure(Path(out), **options)
    typer.echo(f"shapes dataset ready in {root}")


def _pop(args: list[str], key: str) -> str | None:
    """Remove and return a command-specific key=value argument that is not a config key."""
    for arg in args:
        if arg.startswith(f"{key}="):
            args.remove(arg)
            return arg.split("=", 1)[1]
    return None


def run() -> None:
    """Console-script entry point."""
    # The process ends with the command: the last exit handler (registered first, they run last to first) hides every
    # object from the collections of the interpreter's teardown, which would walk them all only to free what the OS
    # frees anyway (0.5 s of every command; docs/performance.md). Cleanups that need a collection run before it
    # (distributed/ddp.py's, registered when a process group starts).
    atexit.register(gc.freeze)
    # --verbose may come anywhere, also after the command's key=value arguments.
    verbose = any(a in {"--verbose", "-v"} for a in sys.argv[1:])
    args = [a for a in sys.argv[1:] if a not in {"--verbose", "-v"}]
    from yoloaccum.process.signals import Interrupted

    try:
        _check_dashes(args)
        # Not standalone: a usage error raises here, to be said in one line; a second Ctrl-C (KeyboardInterrupt)
        # returns 130 at once. Checkpoints are written atomically, so whatever is on disk then is whole.
        code = app(args=args, prog_name="yoloaccum", standalone_mode=False)
    except _CLICK_ERROR as e:  # typer's: an unknown option or command
        commands = {c.name or c.callback.__name__ for c in app.registered_commands}
        command = next((a for a in args if a in commands), None)
        _say_error(f"{e.format_message()}; see yoloaccum {command + ' ' if command else ''}--help")
        sys.exit(2)
    except RanksFailed as e:  # torchrun's ranks said why; its code is ours
        _say_error(str(e))
        sys.exit(e.exit_code)
    except Interrupted as e:  # a graceful stop: last.pt is saved, and the message says how to resume
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)
    except (UserError, Diverged) as e:
        if verbose or os.environ.get("YOLOACCUM_DEBUG") == "1":
            traceback.print_exc()  # where it was raised; the exit code stays the mistake's
        _say_error(str(e))
        sys.exit(e.exit_code if isinstance(e, Diverged) else 2)
    if isinstance(code, int) and code:
        sys.exit(code)


_OPTIONS = {"--json", "--plot", "--help", "--version"}


def _check_dashes(args: list[str]) -> None:
    """`--batch=8` (argparse's habit) is a key=value argument with dashes: say how to write it."""
    for arg in args:
        if arg.startswith("-") and "=" in arg and arg.split("=", 1)[0] not in _OPTIONS:
            raise UserError(f"{arg}: settings are key=value without dashes, as in Ultralytics: {arg.lstrip('-')}")


def _say_error(message: str) -> None:
    from rich.text import Text

    # Text, not markup: a message may hold brackets (freeze=[0, 1])
    Console(stderr=True, highlight=False).print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)


if __name__ == "__main__":
    run()

"""The ``chameleon`` entry point: the typer app and the one place errors become exits."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Annotated

import typer

from chameleon_cli import __version__
from chameleon_cli.errors import (
    INTERRUPTED,
    USAGE,
    USER_ERROR,
    ClickException,
    UsageError,
    classify,
)
from chameleon_cli.output import error
from chameleon_cli.plan_cmd import plan
from chameleon_cli.profile_cmd import CONTEXT as PROFILE_CONTEXT
from chameleon_cli.profile_cmd import profile
from chameleon_cli.run_cmd import CONTEXT, run
from chameleon_cli.simulate_cmd import simulate
from chameleon_cli.timeline_cmd import timeline
from launcher import early

app = typer.Typer(
    name="chameleon",
    help="Fault-tolerant replacement for torchrun: keeps training in place and picks the "
    "recovery policy that finishes the job soonest.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class _State:
    debug = bool(os.environ.get("CHAMELEON_DEBUG"))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"chameleon {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Show the version and exit."
        ),
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    if debug:
        _State.debug = True


app.command("plan")(plan)
app.command("run", context_settings=CONTEXT, add_help_option=False)(run)
app.command("timeline")(timeline)
app.command("simulate")(simulate)
app.command("profile", context_settings=PROFILE_CONTEXT, add_help_option=False)(profile)


def main(argv: list[str] | None = None) -> int:
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="chameleon", standalone_mode=False)
        return code if isinstance(code, int) else 0
    except UsageError as exc:
        # click's "no arguments, so help" carries no message: the help was printed
        message = exc.format_message() or "a command is needed (listed above)"  # type: ignore[attr-defined]
        error(f"chameleon: usage error: {message}")
        return USAGE
    except ClickException as exc:
        error(f"chameleon: error: {exc.format_message()}")  # type: ignore[attr-defined]
        return exc.exit_code  # type: ignore[attr-defined]
    except (typer.Abort, KeyboardInterrupt):
        error("chameleon: interrupted")
        return INTERRUPTED
    except Exception as exc:
        if _State.debug:
            raise
        known = classify(exc)
        if known is None:
            error(
                f"chameleon: internal error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)"
            )
            return USER_ERROR
        code, message = known
        error(message)
        return code


def entry() -> None:
    """The ``chameleon`` command: ``main``, then an exit without the interpreter's
    teardown. With torch imported (the launcher serves TCPStores) the teardown takes
    0.3-0.4 s that nothing needs: every file we write is closed or line-buffered by now,
    the workers and their pumps are joined, and only stdout and stderr hold buffers."""
    code = main()
    early.discard()  # a fork server started for a run that never got to take it
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (| head): no reader
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()

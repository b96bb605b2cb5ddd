"""``python -m chameleon_cli`` and the ``chameleon`` command.

For ``chameleon run``, the warm fork server starts before the rest of the launcher is
imported (launcher/early.py: its import of torch overlaps ours); then the typer app
(chameleon_cli/app.py) runs as for any command."""

from __future__ import annotations

import sys

# Options of the app itself that may come before the command (chameleon_cli/app.py)
ROOT_FLAGS = frozenset({"--debug"})


def main() -> None:
    argv = sys.argv[1:]
    while argv[:1] and argv[0] in ROOT_FLAGS:
        argv = argv[1:]
    if argv[:1] == ["run"]:
        import faulthandler

        from launcher import early
        from launcher.forkserver import STACKS_SIGNAL

        # the launcher's stacks on demand, as its workers' (a hung run's log says where)
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
        early.start(argv[1:])
    from chameleon_cli.app import entry

    entry()


if __name__ == "__main__":
    main()

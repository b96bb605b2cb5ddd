"""The ``chameleon`` command line: thin typer commands over the planner and launcher."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("chameleon-ft")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.1.0+source"

"""What a failed worker said about its failure: its exception, and where in its code.

torchrun's ``@record`` decorator (torch.distributed.elastic.multiprocessing.errors) writes
the exception of a worker that raises to the file ``TORCHELASTIC_ERROR_FILE`` names: its
type and message, the Python call stack and a timestamp. Every worker gets a file of its
own (``<log dir>/attempt_N/<rank>/error.json``); the launcher reads it when the worker
exits non-zero. Without one (the script does not use ``@record``), the traceback Python
printed on the worker's stderr is parsed instead, and failing that the last telling line.

The file's modification time dates the failure (the timestamp inside is whole seconds):
with several ranks failing, the earliest is the root cause and the rest its consequences.

Who is to blame: an exception of the script is user code, unless it is the distributed
backend reporting a broken peer (gloo's connection reset, NCCL's abort), which is what a
healthy rank raises when another one dies.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_MAX_ERROR_FILE = 1 << 20  # a call stack, not a dump: anything longer is cut
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>.+))?$')
# Exceptions a rank raises because a peer failed, not because of its own code.
_PEER_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")
_PEER_TEXT = re.compile(
    r"Connection reset by peer|Connection closed by peer|\[gloo|gloo/transport|NCCL (?:error|communicator)"
    r"|ProcessGroupNCCL|Broken pipe|Socket Timeout",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class ErrorReport:
    message: str  # "ValueError: bad batch size 7"
    where: str | None  # "train.py:41 in step": the innermost frame of the call stack
    written_at: float | None  # when the worker wrote it (the error file's mtime)
    source: str  # "error file" or "stderr"

    @property
    def error_type(self) -> str:
        head = self.message.split(":", 1)[0].strip()
        return head.rsplit(".", 1)[-1] if head and " " not in head else ""

    @property
    def from_a_peer(self) -> bool:
        """The backend reporting a broken peer, not the script's own failure."""
        return self.error_type in _PEER_ERRORS or bool(_PEER_TEXT.search(self.message))


def _innermost(stack: Sequence[str]) -> str | None:
    where = None
    for line in stack:
        match = _FRAME.match(line)
        if match:
            where = f"{match['file']}:{match['line']}"
            if match["func"]:
                where += f" in {match['func'].strip()}"
    return where


def read_error_file(path: Path) -> ErrorReport | None:
    """The report ``@record`` wrote to ``path``; None without a readable one."""
    try:
        stat = path.stat()
        with path.open("rb") as f:
            data = json.loads(f.read(_MAX_ERROR_FILE).decode(errors="replace"))
    except (OSError, ValueError):
        return None
    outer = data.get("message") if isinstance(data, dict) else None
    if isinstance(outer, str):  # a raw message (torch writes this for a non-Python error)
        return ErrorReport(outer.strip()[:300], None, stat.st_mtime, "error file")
    if not isinstance(outer, dict):
        return None
    message = str(outer.get("message") or "").strip()
    extra = outer.get("extraInfo") if isinstance(outer.get("extraInfo"), dict) else {}
    stack = str(extra.get("py_callstack") or "").splitlines()
    if not message and stack:
        message = stack[-1].strip()
    if not message:
        return None
    return ErrorReport(message[:300], _innermost(stack), stat.st_mtime, "error file")


def from_stderr(lines: Sequence[str], *, any_line: bool) -> ErrorReport | None:
    """The last traceback in a worker's stderr: its exception line and innermost frame;
    else (``any_line``, a worker that exited by itself) its last line. A worker killed by
    a signal wrote no last words: its last line is whatever it printed before."""
    # (a script that initialises a default process group itself gets torch.distributed's
    # sys.excepthook, which prefixes every line of a traceback with "[rankN]: ")
    lines = [_RANK_PREFIX.sub("", line) for line in lines if line.strip()]
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback")), default=None)
    if start is not None:
        block = lines[start + 1 :]
        frames_end = max((i for i, line in enumerate(block) if _FRAME.match(line)), default=-1)
        after = [line for line in block[frames_end + 1 :] if not line.startswith(" ")]
        if after:
            return ErrorReport(after[0].strip()[-300:], _innermost(block), None, "stderr")
    for line in reversed(lines):
        stripped = line.strip()
        if stripped.split(":")[0].endswith(("Error", "Exception", "Interrupt")) or (
            "Error:" in stripped
        ):
            return ErrorReport(stripped[-300:], None, None, "stderr")
    if lines and any_line:
        return ErrorReport(lines[-1].strip()[-300:], None, None, "stderr")
    return None

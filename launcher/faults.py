"""Fault injection: kill, hang or exit a chosen rank at a chosen time or step.

    --inject-fault kill:rank=3,at=5         SIGKILL rank 3, 5 s after its workers start
    --inject-fault hang:rank=2,step=10      SIGSTOP rank 2 once it reports step 10
    --inject-fault exit:rank=1,at=4,code=7  rank 1 exits with code 7 (chameleon workers;
                                            a plain script gets SIGTERM instead)
    --inject-fault kill:rank=3,recovery=1   SIGKILL rank 3 while it recovers from the
                                            first failure (chameleon workers)

``attempt=N`` (default 0) picks the restart attempt the fault applies to, so a restarted
job is not killed again. Step-based faults need workers that report steps (scripts using
chameleon_runtime); the launcher says so if a plain script never reports one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class FaultKind(StrEnum):
    KILL = "kill"
    HANG = "hang"
    EXIT = "exit"


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    rank: int
    at_s: float | None = None
    step: int | None = None
    recovery: int | None = None  # during the N-th in-place recovery
    code: int = 1
    attempt: int = 0

    def describe(self) -> str:
        if self.at_s is not None:
            when = f"at {self.at_s:g} s"
        elif self.step is not None:
            when = f"at step {self.step}"
        else:
            when = f"during recovery {self.recovery}"
        return f"{self.kind.value} rank {self.rank} {when} (attempt {self.attempt})"


_SPEC = re.compile(r"^(kill|hang|exit):(.+)$")


def parse_fault(text: str) -> FaultSpec:
    match = _SPEC.match(text.strip())
    if not match:
        raise ValueError(
            f"expected KIND:rank=R,at=SECONDS or KIND:rank=R,step=N with KIND kill, hang or exit; got {text!r}"
        )
    fields: dict[str, str] = {}
    for part in match.group(2).split(","):
        if "=" not in part:
            raise ValueError(f"expected key=value in {text!r}, got {part!r}")
        key, value = (x.strip() for x in part.split("=", 1))
        if key not in ("rank", "at", "step", "recovery", "code", "attempt"):
            raise ValueError(
                f"unknown key {key!r} in {text!r} (rank, at, step, recovery, code, attempt)"
            )
        fields[key] = value
    if "rank" not in fields:
        raise ValueError(f"{text!r} names no rank")
    if sum(k in fields for k in ("at", "step", "recovery")) != 1:
        raise ValueError(f"{text!r} needs exactly one of at=SECONDS, step=N or recovery=N")
    try:
        spec = FaultSpec(
            kind=FaultKind(match.group(1)),
            rank=int(fields["rank"]),
            at_s=float(fields["at"]) if "at" in fields else None,
            step=int(fields["step"]) if "step" in fields else None,
            recovery=int(fields["recovery"]) if "recovery" in fields else None,
            code=int(fields.get("code", "1")),
            attempt=int(fields.get("attempt", "0")),
        )
    except ValueError:
        raise ValueError(
            f"rank, step, code and attempt must be integers and at a number, in {text!r}"
        ) from None
    if (
        spec.rank < 0
        or (spec.at_s is not None and spec.at_s < 0)
        or (spec.step is not None and spec.step < 0)
    ):
        raise ValueError(f"rank, at and step must not be negative, in {text!r}")
    return spec

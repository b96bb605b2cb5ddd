"""The codes ``chameleon run`` exits with, and what each tells a scheduler's requeue logic
(a Slurm requeue chain, a Kubernetes Job's ``podFailurePolicy``; docs/clusters.md).

    0       the job finished
    1       bad input: a config or script that cannot be run (one line on stderr)
    2       bad usage: flags that do not parse
    3       the job cannot go on here: the control plane was lost (the leader's node;
            etcd past --control-outage-timeout), this node was fenced (counted lost while
            cut off or frozen: the others go on), or it failed --health-check
    4       FAULTS_NOT_FIRED: under --require-faults, no fault asked for (--inject-fault)
            fired on this node, while the job otherwise finished (a test of recovery that
            tested nothing)
    75      REQUEUE: stopped for a preemption notice (--signals-to-handle), after the
            workers saved what they could within --preemption-grace: requeue me
    93      GAVE_UP: do not requeue: the restart budget (--max-restarts > 0) is spent, or
            the script raised the same error from the same place in 3 attempts in a row
            (a restart will not help); 93 is the code NVIDIA's ft_launcher gives when it
            judges a job unrecoverable, so recipes that stop on it stop here too
    128+N   stopped by signal N (130: Ctrl-C, 143: SIGTERM) that was not a preemption notice
    other   a worker's failure with no restart budget (--max-restarts 0): the root cause's
            own exit code (128+N when a signal killed it; 1 when it was 75 or 93)
"""

from __future__ import annotations

OK = 0
JOB_FAILED = 3  # also a failure with no exit code of its own (a hang, a lost node)
FAULTS_NOT_FIRED = 4
REQUEUE = 75  # sysexits' EX_TEMPFAIL: "a temporary failure; retry later"
GAVE_UP = 93

#!/bin/bash
# A chain of N jobs, each starting when the one before ended (Slurm's afterany), for
# clusters where a job may not requeue itself. A link that finished (exit 0) or gave up
# (exit 93) cancels the links still queued, so the chain stops there (docs/clusters.md).
#
#   bash examples/slurm/chain.sh 5
set -eu
links=${1:-5}
name="chameleon-chain-$$"  # every link's job name: what a link that ends it cancels
marker="$PWD/.$name"
export CHECKPOINT_DIR="$PWD/checkpoints/$name"  # every link resumes from the same
prev=""
for i in $(seq 1 "$links"); do
    dep=${prev:+--dependency=afterany:$prev}
    prev=$(sbatch --parsable $dep --export=ALL,CHAIN_MARKER="$marker",CHECKPOINT_DIR="$CHECKPOINT_DIR" --wrap "
        if [ -e '$marker' ]; then echo 'chameleon: the chain is over'; exit 0; fi
        bash examples/slurm/train.sbatch; rc=\$?
        if [ \$rc -eq 0 ] || [ \$rc -eq 93 ]; then
            touch '$marker'; scancel --name='$name' --state=PENDING
        fi
        exit \$rc" --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --time=04:00:00 \
        --signal=USR1@180 --job-name="$name" --output=chameleon-chain-%j.out)
    echo "link $i: job $prev"
done

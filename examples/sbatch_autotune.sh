#!/usr/bin/env bash
# Tune FSDP for Llama-8B on 2 nodes x 8 GPUs: each trial is one job step of
# this allocation, one torchrun agent per node, joined by a c10d rendezvous.
#
#   sbatch examples/sbatch_autotune.sh
#
# The study (and every trial's folder) must be on a filesystem all the nodes
# see: trial ranks on the second node write their results there.
#SBATCH --job-name=autotune
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR}"   # on the shared filesystem

autotune run --mem-budget 70GiB --model llama-8b --nnodes 2 --nproc 8 --seq-len 4096 \
    --global-batch-size 512 --storage "sqlite:///${SLURM_SUBMIT_DIR}/studies/autotune.db"
autotune export -f accelerate -o fsdp_2x8.yaml

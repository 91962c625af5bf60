#!/usr/bin/env bash
# The main job's GPU A/B on 2 GPUs under torchrun (EP=2 over NCCL): every arm in one process
# per rank, interleaved steps, medians; writes train.json (the table's figures),
# durations.json (per-node times for the simulator's --durations), the allocator-history PNG
# and a Chrome trace into OUT. Usage: benches/main_job_2gpu.sh OUT [extra train options]
set -euo pipefail
out=${1:?usage: benches/main_job_2gpu.sh OUT [options]}
shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here/torch_ops${PYTHONPATH:+:$PYTHONPATH}"
exec torchrun --standalone --nproc-per-node 2 -m sched_lifetime train \
  --config h200 --steps 4 --microbatches 8 --nccl-channels 2 --out "$out" "$@"

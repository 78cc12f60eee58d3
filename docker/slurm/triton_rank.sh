#!/usr/bin/env bash
# One tritonserver per Slurm task or MPI rank (dgx-b300_triton.sh starts it inside the Triton image). Task 0
# serves HTTP, gRPC and metrics; with a multi-node build (model.yaml mpi: world) every other task
# runs a tritonserver without endpoints whose model serves task 0's MPI session. Each task gets its
# own Python-backend shared-memory prefix (several tasks share a node).
# Usage: triton_rank.sh REPOSITORY HTTP_PORT
set -euo pipefail
repository="$1"
http_port="$2"
rank="${SLURM_PROCID:-${OMPI_COMM_WORLD_RANK:-0}}"  # srun task, or mpirun rank
shm="--backend-config=python,shm-region-prefix-name=dflash_rank${rank}_"
if [[ "${rank}" -eq 0 ]]; then
  exec tritonserver --model-repository="${repository}" "${shm}" \
    --http-port="${http_port}" --grpc-port=$((http_port + 1)) --metrics-port=$((http_port + 2))
fi
exec tritonserver --model-repository="${repository}" "${shm}" \
  --allow-http=false --allow-grpc=false --allow-metrics=false

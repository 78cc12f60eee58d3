#!/usr/bin/env bash
#SBATCH --job-name=dflash-triton
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
# Triton Inference Server on one DGX B300 node over the build's triton/ model repository (python
# backend; with backend trtllm it drives TensorRT-LLM's LLM API, which starts its own TP workers).
#   sbatch --export=ALL,DFLASH_BUILD_DIR=/lustre/builds/gpt-oss-120b dgx-b300_triton.sh
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "${SCRIPT_DIR}/common.sh"
dflash_load_env
if [[ "${SLURM_NTASKS:-1}" -ne 1 ]]; then
  echo "error: the Triton job runs one server process (SLURM_NTASKS=${SLURM_NTASKS}); TP workers are spawned by it" >&2
  exit 2
fi
if [[ ! -d "${DFLASH_BUILD_DIR}/triton/${DFLASH_TRITON_MODEL}" ]]; then
  echo "error: ${DFLASH_BUILD_DIR}/triton/${DFLASH_TRITON_MODEL} not found: build with serve.triton: true" >&2
  exit 2
fi
http_port=$((DFLASH_PORT))
srun --ntasks=1 \
  --container-image="${DFLASH_CONTAINER_IMAGE}" \
  --container-mounts="${DFLASH_BUILD_DIR}:${DFLASH_BUILD_DIR}" \
  tritonserver --model-repository="${DFLASH_BUILD_DIR}/triton" \
    --http-port="${http_port}" --grpc-port=$((http_port + 1)) --metrics-port=$((http_port + 2)) &
server_pid=$!

dflash_wait_healthy "http://127.0.0.1:${http_port}/v2/health/ready" "${DFLASH_HEALTH_TIMEOUT}" "${server_pid}" || exit 1
wait "${server_pid}"

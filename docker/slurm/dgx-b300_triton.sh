#!/usr/bin/env bash
#SBATCH --job-name=dflash-triton
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
# Triton Inference Server over the build's triton/ model repository, in the image that holds
# tritonserver, the pinned TensorRT-LLM and dflash_trt (docker/Dockerfile.triton; DFLASH_TRITON_IMAGE).
# One node: one tritonserver task; with backend trtllm its TensorRT-LLM spawns the TP workers.
# Several nodes (model.yaml mpi: world): one task per rank; task 0 serves, its model leads an
# MpiCommSession over all ranks, as TensorRT-LLM's LLM-API Triton model does.
#   sbatch --export=ALL,DFLASH_BUILD_DIR=/lustre/builds/gpt-oss-120b dgx-b300_triton.sh
#   sbatch --nodes=2 --ntasks=16 --export=ALL,DFLASH_BUILD_DIR=/lustre/builds/big dgx-b300_triton.sh
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "${SCRIPT_DIR}/common.sh"
dflash_load_env
tasks=1
if (( DFLASH_NODES > 1 )); then
  tasks="${DFLASH_RANKS}"
fi
if [[ "${SLURM_NTASKS:-1}" -ne "${tasks}" ]]; then
  echo "error: SLURM_NTASKS=${SLURM_NTASKS:-1} but this build's Triton job runs ${tasks} task(s) (nodes ${DFLASH_NODES})" >&2
  exit 2
fi
if [[ ! -d "${DFLASH_BUILD_DIR}/triton/${DFLASH_TRITON_MODEL}" ]]; then
  echo "error: ${DFLASH_BUILD_DIR}/triton/${DFLASH_TRITON_MODEL} not found: build with serve.triton: true" >&2
  exit 2
fi
dflash_check_trtllm_version "${DFLASH_TRITON_IMAGE}"
http_port=$((DFLASH_PORT))
srun --mpi=pmix --ntasks="${tasks}" --ntasks-per-node="$(( tasks < DFLASH_GPUS_PER_NODE ? tasks : DFLASH_GPUS_PER_NODE ))" \
  --container-image="${DFLASH_TRITON_IMAGE}" \
  --container-mounts="${DFLASH_BUILD_DIR}:${DFLASH_BUILD_DIR}" \
  bash "${DFLASH_BUILD_DIR}/launch/triton_rank.sh" "${DFLASH_BUILD_DIR}/triton" "${http_port}" &
server_pid=$!

dflash_wait_healthy "http://127.0.0.1:${http_port}/v2/health/ready" "${DFLASH_HEALTH_TIMEOUT}" "${server_pid}" || exit 1
wait "${server_pid}"

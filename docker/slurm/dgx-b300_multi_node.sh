#!/usr/bin/env bash
#SBATCH --job-name=dflash-trtllm-multinode
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
# Several DGX B300 nodes: one MPI rank per GPU (rank -> GPU is rank % gpus_per_node), rank 0
# serves HTTP on the first node. --nodes / --ntasks-per-node must match the build's parallel
# section (checked below: SLURM_NTASKS == tp * pp).
#   sbatch --nodes=2 --export=ALL,DFLASH_BUILD_DIR=/lustre/builds/big dgx-b300_multi_node.sh
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "${SCRIPT_DIR}/common.sh"
dflash_load_env
dflash_check_ranks
dflash_check_trtllm_version "${DFLASH_CONTAINER_IMAGE}"

head_node="$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)"
srun --mpi=pmix \
  --nodes="${DFLASH_NODES}" --ntasks="${DFLASH_RANKS}" --ntasks-per-node="${DFLASH_GPUS_PER_NODE}" \
  --container-image="${DFLASH_CONTAINER_IMAGE}" \
  --container-mounts="${DFLASH_BUILD_DIR}:${DFLASH_BUILD_DIR}" \
  trtllm-llmapi-launch trtllm-serve "${DFLASH_BUILD_DIR}/target" \
    --config "${DFLASH_BUILD_DIR}/llm_api_options.yaml" \
    --host "${DFLASH_HOST}" --port "${DFLASH_PORT}" --backend pytorch \
    --served_model_name "${DFLASH_SERVED_MODEL_NAME}" \
    --tp_size "${DFLASH_TP}" --pp_size "${DFLASH_PP}" --ep_size "${DFLASH_EP}" &
server_pid=$!

dflash_wait_healthy "http://${head_node}:${DFLASH_PORT}/health" "${DFLASH_HEALTH_TIMEOUT}" "${server_pid}" || exit 1
wait "${server_pid}"

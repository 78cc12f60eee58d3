#!/usr/bin/env bash
#SBATCH --job-name=dflash-trtllm-tp8
#SBATCH --nodes=1
#SBATCH --ntasks=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
# One DGX B300 node, TP8 (EP per the build): trtllm-serve with DFlash speculative decoding.
#   sbatch --export=ALL,DFLASH_BUILD_DIR=/lustre/builds/gpt-oss-120b dgx-b300_tp8_single_node.sh
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "${SCRIPT_DIR}/common.sh"
dflash_load_env
dflash_check_ranks
dflash_check_trtllm_version "${DFLASH_CONTAINER_IMAGE}"

srun --mpi=pmix \
  --ntasks="${DFLASH_RANKS}" --ntasks-per-node="${DFLASH_GPUS_PER_NODE}" \
  --container-image="${DFLASH_CONTAINER_IMAGE}" \
  --container-mounts="${DFLASH_BUILD_DIR}:${DFLASH_BUILD_DIR}" \
  trtllm-llmapi-launch trtllm-serve "${DFLASH_BUILD_DIR}/target" \
    --config "${DFLASH_BUILD_DIR}/llm_api_options.yaml" \
    --host "${DFLASH_HOST}" --port "${DFLASH_PORT}" --backend pytorch \
    --served_model_name "${DFLASH_SERVED_MODEL_NAME}" \
    --tp_size "${DFLASH_TP}" --pp_size "${DFLASH_PP}" --ep_size "${DFLASH_EP}" &
server_pid=$!

dflash_wait_healthy "http://127.0.0.1:${DFLASH_PORT}/health" "${DFLASH_HEALTH_TIMEOUT}" "${server_pid}" || exit 1
wait "${server_pid}"

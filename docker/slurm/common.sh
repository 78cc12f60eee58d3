#!/usr/bin/env bash
# Shared by the DGX B300 job scripts: load a built directory's launch/env.sh, check the Slurm
# allocation against the build's parallel layout, check that a container image holds the pinned
# TensorRT-LLM release, and wait for an HTTP health endpoint.
# Usage (sourced): DFLASH_BUILD_DIR=/path/to/build source common.sh

dflash_load_env() {
  if [[ -z "${DFLASH_BUILD_DIR:-}" ]]; then
    echo "error: set DFLASH_BUILD_DIR to the output of 'dflash-trt build'" >&2
    exit 2
  fi
  if [[ ! -f "${DFLASH_BUILD_DIR}/launch/env.sh" ]]; then
    echo "error: ${DFLASH_BUILD_DIR}/launch/env.sh not found: is this a dflash-trt build directory?" >&2
    exit 2
  fi
  # shellcheck source=/dev/null
  source "${DFLASH_BUILD_DIR}/launch/env.sh"
}

dflash_check_ranks() {
  local expected=$((DFLASH_TP * DFLASH_PP))
  local ntasks="${SLURM_NTASKS:-0}"
  if [[ "${ntasks}" -ne "${expected}" ]]; then
    echo "error: SLURM_NTASKS=${ntasks} but the build needs tp*pp = ${DFLASH_TP}*${DFLASH_PP} = ${expected} ranks" >&2
    exit 2
  fi
  if [[ "${SLURM_JOB_NUM_NODES:-1}" -ne "${DFLASH_NODES}" ]]; then
    echo "error: the job has ${SLURM_JOB_NUM_NODES:-1} node(s), the build was planned for ${DFLASH_NODES}" >&2
    exit 2
  fi
}

# dflash_check_trtllm_version IMAGE: the image's tensorrt_llm must be the release the build's
# LLM-API options were checked against (DFLASH_TRTLLM_VERSION, from dflash_trt's pinned data file).
dflash_check_trtllm_version() {
  local image="$1" found
  found="$(srun --ntasks=1 --nodes=1 --container-image="${image}" \
    python3 -c 'import tensorrt_llm; print(tensorrt_llm.__version__)' 2>/dev/null | tail -n 1 || true)"
  if [[ "${found}" != "${DFLASH_TRTLLM_VERSION}" ]]; then
    echo "error: ${image} has tensorrt_llm '${found:-none}', the build was checked against ${DFLASH_TRTLLM_VERSION}: use the pinned image" >&2
    exit 2
  fi
}

# dflash_wait_healthy URL TIMEOUT_S PID: poll URL until it answers 200, the server exits, or time runs out;
# on failure the server PID is killed (if still running) and the function returns 1.
dflash_wait_healthy() {
  local url="$1" timeout="$2" pid="$3" waited=0
  until curl -sf -o /dev/null "${url}"; do
    if ! kill -0 "${pid}" 2>/dev/null; then
      echo "error: the server exited before ${url} became healthy" >&2
      return 1
    fi
    if (( waited >= timeout )); then
      echo "error: ${url} not healthy after ${timeout} s" >&2
      kill "${pid}" 2>/dev/null || true
      return 1
    fi
    sleep 5
    waited=$((waited + 5))
  done
  echo "healthy after ${waited} s: ${url}"
}

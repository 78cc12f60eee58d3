"""dflash_trt: DFlash block-diffusion speculative decoding, from checkpoints to served deployments.

DFlash (Chen et al., "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036)
drafts a whole block of tokens in one forward of a small drafter conditioned on hidden states
tapped from the target model; the target verifies the block in one forward, so the output is
exactly the target's.

Importing this package needs neither TensorRT, TensorRT-LLM, CUDA nor MPI: those are imported
lazily where they are used.
"""
from __future__ import annotations

__version__ = "0.1.0"

from dflash_trt.errors import (  # noqa: E402
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    ContextLengthError,
    DFlashError,
    InputError,
)

__all__ = [
    "__version__",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "ContextLengthError",
    "DFlashError",
    "InputError",
]

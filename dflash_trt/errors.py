"""Typed errors for users of dflash_trt.

Every error a user can cause (bad config, bad checkpoint, bad request) is one of these, with a
message that says what to do. `assert` is used only for internal invariants.
"""
from __future__ import annotations


class DFlashError(Exception):
    """Base class of every user-facing error raised by dflash_trt."""


class ConfigError(DFlashError, ValueError):
    """A configuration (drafter config.json, build YAML, serve YAML, CLI flags) is invalid."""


class CheckpointError(DFlashError, ValueError):
    """A checkpoint on disk is missing, malformed, or does not match its config."""


class InputError(DFlashError, ValueError):
    """A request is invalid: empty prompt, token ids outside the vocabulary, bad sampling values."""


class ContextLengthError(InputError):
    """A request does not fit into the model's context window."""


class BackendUnavailableError(DFlashError, RuntimeError):
    """An optional backend (TensorRT-LLM, CUDA, MPI, Triton) is not installed or not usable here."""

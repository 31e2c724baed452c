"""Remat with offload: ``jaxvmm.checkpoint`` and its policies."""

from .checkpoint import checkpoint, print_saved_residuals, remat, saved_residuals
from . import policies

__all__ = ["checkpoint", "remat", "policies", "saved_residuals", "print_saved_residuals"]

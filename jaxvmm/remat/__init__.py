"""Remat with offload: ``jaxvmm.checkpoint`` and its policies."""

from .checkpoint import checkpoint, remat
from . import policies

__all__ = ["checkpoint", "remat", "policies"]

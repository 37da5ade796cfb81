"""Gradient communication: compression hooks for DDP, their byte accounting, and
measurements of collectives (``meshyard.comm.collectives``)."""

from meshyard.comm.hooks import CastCompression, GradientCompression, NoCompression
from meshyard.comm.powersgd import PowerSGDCompression
from meshyard.comm.registry import COMPRESSION_METHODS, attach_compression, build_compression
from meshyard.comm.topk import TopKCompression

__all__ = [
    "COMPRESSION_METHODS", "CastCompression", "GradientCompression", "NoCompression", "PowerSGDCompression",
    "TopKCompression", "attach_compression", "build_compression",
]

"""``meshyard verify``: does a parallel layout train the same model as one process?"""

from meshyard.verify.compare import Tolerance, VerifyReport, tolerance_for, verify_layout

__all__ = ["Tolerance", "VerifyReport", "tolerance_for", "verify_layout"]

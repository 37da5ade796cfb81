"""Exporting a trained model for serving: ``meshyard export`` (safetensors, TorchScript,
ONNX, optionally INT8), each export checked against the eager model on held-out data."""

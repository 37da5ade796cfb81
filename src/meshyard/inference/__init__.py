"""A trained model at inference: what a served model is and how it is loaded (a run's
checkpoint, or a file ``meshyard export`` wrote), the engines that run it, KV-cache
decoding, sampling and the tokenizer. ``meshyard.serve`` and ``meshyard.export`` stand on
it; it imports neither."""

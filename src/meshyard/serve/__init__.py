"""Serving trained models over HTTP: ``meshyard serve``."""

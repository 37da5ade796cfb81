"""fsspec storage options given on a command line as ``--storage-option KEY=VALUE``.

Checkpoint tools and ``meshyard data prepare`` both take them; s3fs wants an endpoint
inside ``client_kwargs``, so ``endpoint_url`` goes there. Imports nothing of meshyard: each
command turns the ``ValueError`` into its own error.
"""

from __future__ import annotations


def options_from_pairs(pairs: list[str]) -> dict[str, object]:
    """``["KEY=VALUE", ...]`` as fsspec storage options; ValueError names a malformed pair."""
    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option '{pair}' is not KEY=VALUE; give e.g. "
                             "--storage-option endpoint_url=http://127.0.0.1:9000")
        if key == "endpoint_url":  # s3fs takes the endpoint inside client_kwargs
            options.setdefault("client_kwargs", {})["endpoint_url"] = value  # type: ignore[index]
        else:
            options[key] = value
    return options

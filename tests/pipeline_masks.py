"""Which test models this torch can pipeline.

Before torch 2.13 a pipeline's training stages cannot receive a tensor that is not floating
point, so meshyard refuses, before the run, to pipeline a model whose stages pass one on
(tests/parallel/test_pipeline_user_models.py checks that refusal on every torch, and that
it refuses exactly the models named here). Every Hugging Face model the tests build passes
its boolean attention mask from stage to stage; on such a torch their pipelined cells are
left out of the jobs that train them and skipped with this reason.
"""

from __future__ import annotations

import pytest

from meshyard.parallel.pipeline_trace import RECEIVES_NON_FLOAT

# Names in tests/models/user_models.py; "hf" is tests/checkpoint/test_init_from.py's GPT-2.
PASS_MASKS_ON = frozenset({"hf_gpt2", "hf_opt", "hf_llama", "hf_neox", "hf_mistral", "hf"})
REASON = "this torch cannot send a boolean attention mask between pipeline stages (2.13 can): meshyard refuses the layout"


def can_train(model: str, overrides: tuple[str, ...] | list[str]) -> bool:
    """Whether this torch trains ``model`` under the layout of ``overrides`` (CLI overrides)."""
    pipelined = any(override.startswith("--parallel.pp=") and override != "--parallel.pp=1" for override in overrides)
    return RECEIVES_NON_FLOAT or model not in PASS_MASKS_ON or not pipelined


def skip_unless_trainable(model: str, overrides: tuple[str, ...] | list[str]) -> None:
    """Skip a test of ``model`` under the layout of ``overrides`` where this torch cannot train it."""
    if not can_train(model, overrides):
        pytest.skip(REASON)

"""``logits_of``: what a model's forward returned, reduced to the logits the loss needs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from meshyard.models.outputs import logits_of

LOGITS = torch.randn(2, 3, 5)


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def test_a_tensor_is_taken_as_is():
    assert logits_of(LOGITS) is LOGITS


def test_the_logits_of_an_object_or_a_dict():
    assert logits_of(Output(LOGITS)) is LOGITS
    assert logits_of({"logits": LOGITS, "hidden": None}) is LOGITS


def test_a_hugging_face_model_output():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    assert logits_of(outputs.CausalLMOutputWithPast(logits=LOGITS)) is LOGITS


@pytest.mark.parametrize("returned, named", [
    ((LOGITS, LOGITS), "a tuple of 2 items"),
    ({"scores": LOGITS}, "a dict with keys ['scores']"),
    (Output(logits=None), "a value of type Output"),
    (None, "a value of type NoneType"),
])
def test_anything_else_names_what_came_back_and_what_to_return(returned, named):
    with pytest.raises(TypeError) as error:
        logits_of(returned)
    message = str(error.value)
    assert named in message and "'logits'" in message and "(batch, sequence, vocabulary) tensor" in message

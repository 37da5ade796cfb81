"""The router: canary shares, versions pinned by header, and 404s that name what exists."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from meshyard.inference.source import ModelSource
from meshyard.serve.routing import RouteError, Router
from meshyard.serve.types import NotFound


def source(name: str, version: str, path: str | None = None) -> ModelSource:
    return ModelSource(path=path or f"/runs/{name}/{version}", name=name, version=version, vocab_size=8,
                       context_length=4, tokenizer=None, estimated_bytes=100, config=None)


MAIN = source("gpt", "step-40.1a2b3c")
CANARY = source("gpt", "step-80.4d5e6f")
OTHER = source("mlp", "step-10.000aaa")


@pytest.mark.parametrize("weight", [0.1, 0.5])
def test_a_canary_takes_its_share_of_2000_requests_within_5_percent(weight):
    router = Router.from_specs([MAIN, OTHER], [(CANARY, weight)], rng=random.Random(7))
    counts = Counter(router.choose("gpt").version for _ in range(2000))
    assert set(counts) == {MAIN.version, CANARY.version}
    assert abs(counts[CANARY.version] / 2000 - weight) < 0.05
    assert {router.choose("mlp") for _ in range(50)} == {OTHER}  # other names keep all their traffic


def test_listing_gives_every_version_and_its_share():
    router = Router.from_specs([MAIN, OTHER], [(CANARY, 0.25)])
    assert router.listing() == [(MAIN, 0.75), (CANARY, 0.25), (OTHER, 1.0)]
    assert router.names() == ["gpt", "mlp"]
    assert router.versions("gpt") == [MAIN.version, CANARY.version]


def test_the_default_rng_repeats_its_choices():
    first = Router.from_specs([MAIN], [(CANARY, 0.5)])
    second = Router.from_specs([MAIN], [(CANARY, 0.5)])
    assert [first.choose("gpt") for _ in range(100)] == [second.choose("gpt") for _ in range(100)]


def test_a_pinned_version_always_wins():
    router = Router.from_specs([MAIN], [(CANARY, 0.01)], rng=random.Random(0))
    assert {router.choose("gpt", CANARY.version) for _ in range(200)} == {CANARY}
    assert {router.choose("gpt", MAIN.version) for _ in range(200)} == {MAIN}


def test_an_unknown_version_is_404_naming_the_versions():
    router = Router.from_specs([MAIN], [(CANARY, 0.1)])
    with pytest.raises(NotFound) as missing:
        router.choose("gpt", "step-99.ffffff")
    assert missing.value.status == 404
    message = missing.value.message
    assert "no version 'step-99.ffffff'" in message
    assert MAIN.version in message and CANARY.version in message and "X-Model-Version" in message


def test_an_unknown_name_is_404_naming_the_served_models():
    router = Router.from_specs([MAIN, OTHER], [])
    with pytest.raises(NotFound) as missing:
        router.choose("bert")
    assert missing.value.status == 404
    assert "'bert'" in missing.value.message and "'gpt', 'mlp'" in missing.value.message


@pytest.mark.parametrize("main, canaries, problem", [
    ([MAIN, source("gpt", "step-1.000000", "/elsewhere")], [], "two models are served under the name 'gpt'"),
    ([MAIN], [(OTHER, 0.1)], "the model 'mlp', which is not served (served: 'gpt')"),
    ([MAIN], [(CANARY, 1.0)], "between 0 and 1 exclusive"),
    ([MAIN], [(CANARY, 0.0)], "between 0 and 1 exclusive"),
    ([MAIN], [(CANARY, 0.6), (source("gpt", "step-90.aaaaaa"), 0.4)], "leaving nothing for its main version"),
    ([MAIN], [(source("gpt", MAIN.version, "/copy"), 0.2)], "already serves"),
])
def test_contradicting_specs_are_refused_with_the_fix(main, canaries, problem):
    with pytest.raises(RouteError) as refused:
        Router.from_specs(main, canaries)
    assert problem in str(refused.value)


def test_routes_whose_shares_do_not_sum_to_one_are_refused():
    with pytest.raises(RouteError, match="sum to 0.9"):
        Router({"gpt": [(MAIN, 0.6), (CANARY, 0.3)]})

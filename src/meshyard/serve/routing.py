"""Which model version answers a request: served names, their versions and canary weights.

Each served name has a main version and, optionally, canaries that take a share of its
traffic (``--canary NAME=PATH:WEIGHT``). A request picks a version by weighted chance, or
names one in the ``X-Model-Version`` header, which always wins.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from meshyard.serve.types import NotFound

if TYPE_CHECKING:
    from meshyard.inference.source import ModelSource

VERSION_HEADER = "X-Model-Version"

# Weights are given as decimals on the command line; their sum may be off by rounding.
_SUM_TOLERANCE = 1e-6


class RouteError(ValueError):
    """Served models or canaries that contradict each other; the message names the fix."""


class Router:
    """Picks a ``ModelSource`` for a served name by its routes' weights.

    ``routes`` maps each served name to its versions and their shares of its traffic; the
    shares of one name sum to 1. ``rng`` draws the choices; the default is seeded, so that a
    server's sequence of choices repeats from one start to the next.
    """

    def __init__(self, routes: dict[str, list[tuple[ModelSource, float]]],
                 rng: random.Random | None = None) -> None:
        for name, versions in routes.items():
            _check_route(name, versions)
        self._routes = {name: list(versions) for name, versions in routes.items()}
        self._rng = rng if rng is not None else random.Random(0)

    @classmethod
    def from_specs(cls, main: list[ModelSource], canaries: list[tuple[ModelSource, float]],
                   rng: random.Random | None = None) -> Router:
        """Routes for ``main`` (one version per name) and ``canaries`` (a source of a served
        name and the share WEIGHT, 0 < WEIGHT < 1, of that name's traffic it takes; the rest
        stays on the main version)."""
        routes: dict[str, list[tuple[ModelSource, float]]] = {}
        for source in main:
            if source.name in routes:
                raise RouteError(
                    f"two models are served under the name '{source.name}' ({routes[source.name][0][0].path} "
                    f"and {source.path}); give each its own name with NAME=PATH, or serve a new version "
                    f"of one as a canary with --canary {source.name}=PATH:WEIGHT")
            routes[source.name] = [(source, 1.0)]
        for source, weight in canaries:
            _add_canary(routes, source, weight)
        return cls(routes, rng)

    def names(self) -> list[str]:
        """The served names, in the order they were given."""
        return list(self._routes)

    def versions(self, name: str) -> list[str]:
        """The versions served under ``name``, main version first."""
        return [source.version for source, _ in self._versions_of(name)]

    def choose(self, name: str, pinned_version: str | None = None) -> ModelSource:
        """The version that answers a request for ``name``: ``pinned_version`` when given (the
        ``X-Model-Version`` header), else one drawn by the weights. Unknown names and versions
        raise ``NotFound`` naming the known ones."""
        versions = self._versions_of(name)
        if pinned_version is not None:
            for source, _ in versions:
                if source.version == pinned_version:
                    return source
            known = ", ".join(f"'{source.version}'" for source, _ in versions)
            raise NotFound(
                f"model '{name}' has no version '{pinned_version}'; it serves {known}. Send one of these in "
                f"the {VERSION_HEADER} header, or leave the header out to let the server choose.")
        draw = self._rng.random()
        for source, weight in versions:
            draw -= weight
            if draw < 0:
                return source
        return versions[-1][0]  # the weights' rounding left a sliver past the last one

    def listing(self) -> list[tuple[ModelSource, float]]:
        """Every served version and its share of its name's traffic, main versions first."""
        return [entry for versions in self._routes.values() for entry in versions]

    def _versions_of(self, name: str) -> list[tuple[ModelSource, float]]:
        versions = self._routes.get(name)
        if versions is None:
            known = ", ".join(f"'{known}'" for known in self._routes) or "none"
            raise NotFound(f"no model is served under the name '{name}'; this server serves: {known}. "
                           f"Use one of these names in the URL, e.g. /v1/models/NAME/generate.")
        return versions


def _add_canary(routes: dict[str, list[tuple[ModelSource, float]]], source: ModelSource, weight: float) -> None:
    """Gives ``source`` the share ``weight`` of its name's traffic, taken from the main version."""
    versions = routes.get(source.name)
    if versions is None:
        known = ", ".join(f"'{name}'" for name in routes) or "none"
        raise RouteError(f"the canary {source.path} is for the model '{source.name}', which is not served "
                         f"(served: {known}); name a served model in --canary NAME=PATH:WEIGHT")
    if not 0.0 < weight < 1.0:
        raise RouteError(f"the canary weight of {source.name}={source.path} is {weight}; give the share of "
                         f"'{source.name}' traffic it takes, between 0 and 1 exclusive (e.g. :0.1)")
    if any(known.version == source.version for known, _ in versions):
        raise RouteError(f"the canary {source.path} has version '{source.version}', which '{source.name}' "
                         f"already serves; a canary must be another checkpoint or export")
    main, main_weight = versions[0]
    if main_weight - weight <= _SUM_TOLERANCE:
        raise RouteError(f"the canaries of '{source.name}' take {1 - main_weight + weight:g} of its traffic, "
                         f"leaving nothing for its main version; their weights must sum to less than 1")
    versions[0] = (main, main_weight - weight)
    versions.append((source, weight))


def _check_route(name: str, versions: list[tuple[ModelSource, float]]) -> None:
    if not versions:
        raise RouteError(f"the model '{name}' has no versions to serve")
    if any(weight < 0 for _, weight in versions):
        raise RouteError(f"the model '{name}' has a negative traffic share: {[w for _, w in versions]}")
    total = sum(weight for _, weight in versions)
    if abs(total - 1.0) > _SUM_TOLERANCE:
        raise RouteError(f"the traffic shares of '{name}' sum to {total:g}, not 1: {[w for _, w in versions]}")
    if any(source.name != name for source, _ in versions):
        raise RouteError(f"the route '{name}' holds a version of another model: "
                         f"{sorted({source.name for source, _ in versions})}")

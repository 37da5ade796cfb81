"""One spawn of gloo ranks for the jobs of several test modules that need that many ranks.

Starting ranks costs more than a short multi-rank job runs: every rank imports torch,
and the ranks share the machine's cores while they do. So a module registers each job
of a world size when it is imported (pytest imports every module it collects before the
first test runs); the first test that asks for a result runs every registered job of
that world size whose module has a selected test, one after another in one spawn
(``tests/ranks.py``), and the session keeps all their results.

Jobs run in the order their modules were imported (those registered ``first`` before
the others), each in the processes the jobs before it used: each sets its own seeds and
builds its own meshes. A job whose ``make`` raises (a configuration refused) does not
run, and asking for its result raises ``JobFailed`` with that error. A job that raises
ends the spawn, as it would have ended a spawn of its own, and asking for its result
raises ``JobFailed`` with the rank's error; the jobs after it run again in a fresh
spawn, so one module's failure stays its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from tests.ranks import run_on_ranks

RankFunction = Callable[..., Any]
"""``fn(rank, world_size, *args)``, module-level so that spawned ranks can import it."""
JobMaker = Callable[[pytest.FixtureRequest, Path], "tuple[RankFunction, tuple] | None"]
"""``make(request, folder)``: the job's rank function and its arguments after (rank,
world_size), or None where the session selected nothing that needs the job; ``folder``
is the job's own (empty) temporary folder."""


class JobFailed(RuntimeError):
    """A rank raised or died during this job; ``folder`` is the job's own, with whatever
    the job wrote there before."""

    def __init__(self, message: str, folder: Path) -> None:
        super().__init__(message)
        self.folder = folder


@dataclass(frozen=True)
class _Registered:
    module: str
    make: JobMaker
    first: bool


@dataclass(frozen=True)
class _Job:
    name: str
    folder: Path
    fn: RankFunction
    args: tuple


@dataclass(frozen=True)
class _Outcome:
    folder: Path
    per_rank: list[Any] | None  # what each rank's function returned; None where the job failed
    error: str = ""


_REGISTERED: dict[int, dict[str, _Registered]] = {}
_RESULTS = pytest.StashKey[dict[int, dict[str, _Outcome]]]()


def register(world_size: int, name: str, module: str, make: JobMaker, first: bool = False) -> None:
    """Job ``name`` on ``world_size`` ranks for the tests of ``module`` (its ``__name__``);
    ``first`` runs it before the others (in processes that have run nothing else yet)."""
    jobs = _REGISTERED.setdefault(world_size, {})
    assert name not in jobs, f"two {world_size}-rank jobs named {name!r}"
    jobs[name] = _Registered(module, make, first)


def result(request: pytest.FixtureRequest, world_size: int, name: str) -> tuple[Path, list[Any]]:
    """Job ``name``'s folder and what each rank returned (indexed by rank), from the
    session's spawn of ``world_size`` ranks (run now if this is the first result asked
    of it). Raises ``JobFailed`` where a rank raised or died during the job."""
    done = request.config.stash.setdefault(_RESULTS, {})
    if world_size not in done:
        done[world_size] = _run_registered(request, world_size)
    assert name in done[world_size], f"{name!r} did not run: no selected test of its module when the spawn started"
    outcome = done[world_size][name]
    if outcome.per_rank is None:
        raise JobFailed(outcome.error, outcome.folder)
    return outcome.folder, outcome.per_rank


def _run_registered(request: pytest.FixtureRequest, world_size: int) -> dict[str, _Outcome]:
    selected = {item.module.__name__ for item in request.session.items if getattr(item, "module", None) is not None}
    registered = sorted(_REGISTERED.get(world_size, {}).items(), key=lambda named: not named[1].first)
    root = request.getfixturevalue("tmp_path_factory").mktemp(f"shared-{world_size}-ranks")
    pending: list[_Job] = []
    outcomes: dict[str, _Outcome] = {}
    for index, (name, job) in enumerate(registered):
        if job.module in selected:
            folder = root / f"job{index}"
            folder.mkdir()
            try:
                made = job.make(request, folder)
            except Exception as refused:  # such as a configuration refused: the other jobs still run
                outcomes[name] = _Outcome(folder, None, f"{type(refused).__name__} while making the job: {refused}")
                continue
            if made is not None:
                pending.append(_Job(name, folder, *made))
    for attempt in range(len(pending)):  # each spawn after the first starts past a failed job
        if not pending:
            break
        outputs = root / f"outputs{attempt}"
        outputs.mkdir()
        error = ""
        try:
            run_on_ranks(_run_each, str(outputs), [(job.fn, job.args) for job in pending], world_size=world_size)
        except Exception as ended:  # a rank raised or died: the jobs finished before keep their results
            error = f"{type(ended).__name__} in the shared {world_size}-rank spawn: {ended}"
        for index, job in enumerate(pending):
            files = [outputs / f"job{index}-rank{rank}.pt" for rank in range(world_size)]
            if not all(file.exists() for file in files):
                outcomes[job.name] = _Outcome(job.folder, None, error or "it returned no result")
                pending = pending[index + 1:]
                break
            outcomes[job.name] = _Outcome(job.folder, [torch.load(file, weights_only=False) for file in files])
        else:
            pending = []
    return outcomes


def _run_each(rank: int, world_size: int, outputs: str, jobs: list[tuple[RankFunction, tuple]]) -> None:
    for index, (fn, args) in enumerate(jobs):
        value = fn(rank, world_size, *args)
        torch.save(value, Path(outputs) / f"job{index}-rank{rank}.pt")
        dist.barrier()  # every rank is done with this job before the next one starts

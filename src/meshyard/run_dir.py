"""The run directory: every path and record of a run, in one place.

Its layout is the product's contract (the README's table of run-directory files): a later
``meshyard doctor``, ``resume``, ``serve`` or ``ckpt`` finds everything there by these
names, and this module is the only place that spells them. It imports nothing of meshyard
(and nothing heavy), so every package may use it.

A run directory is named after the job, never after the clock, whenever the environment
names a job (``runtime.job``): a restarted, requeued or re-launched job then opens the
same folder on every node and finds its checkpoints there.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory, and the JSON records that several modules share.

    The names are class attributes too, for folders that are URLs (``checkpoint.locate``
    joins them itself) and for messages. ``path`` may be given as a string."""

    path: Path

    CONFIG: ClassVar[str] = "config.toml"  # the resolved configuration; running it repeats the run
    RUN_FACTS: ClassVar[str] = "run.json"  # layout, batch, versions, host, run id, checkpoint folder
    SUMMARY: ClassVar[str] = "summary.json"  # rank 0's summary at the end
    METRICS: ClassVar[str] = "metrics.jsonl"  # one line per step (rank 0)
    RESTARTS: ClassVar[str] = "restarts.jsonl"  # one line per restart or resume
    GUARD: ClassVar[str] = "guard.jsonl"  # one line per step the spike and NaN guard did not keep, and per rollback
    PREEMPTION: ClassVar[str] = "preemption.json"  # the last preemption, kept by rank 0
    LOGS: ClassVar[str] = "logs"  # rank logs, the agent's log, failure records, preemption copies
    FAILURES: ClassVar[str] = "failures"  # under LOGS
    AGENT_LOG: ClassVar[str] = "agent.log"  # under LOGS
    HANG: ClassVar[str] = "hang"  # the hang watchdog's stacks and reports
    PROFILE: ClassVar[str] = "profile"  # torch.profiler's traces and tables of metrics.profile_steps
    CHECKPOINTS: ClassVar[str] = "checkpoints"  # unless checkpoint.dir names another folder
    RUN_ID: ClassVar[str] = "run_id"  # the id this run's checkpoints carry
    REPORT: ClassVar[str] = "report.html"  # meshyard doctor report
    PROMETHEUS: ClassVar[str] = "prometheus.json"  # where the Prometheus endpoint listens
    TENSORBOARD: ClassVar[str] = "tensorboard"
    # Weights & Biases' files (metrics.wandb): the wandb library names this folder itself,
    # under the directory it is given, so the name is its and cannot be chosen here.
    WANDB: ClassVar[str] = "wandb"
    # The tokenizer the text was tokenized with (not for data.tokenizer = "bytes"), under the
    # name Hugging Face gives it, so a run directory is itself a tokenizer folder; it is
    # also the name looked for in a folder given as data.tokenizer.
    TOKENIZER: ClassVar[str] = "tokenizer.json"
    # How chat messages become a prompt, under Hugging Face's names too: a Jinja file, or the
    # "chat_template" (with "bos_token" and "eos_token") of tokenizer_config.json. A run has
    # them only where the user put them beside its tokenizer; the server and the Hugging Face
    # export read them from there.
    CHAT_TEMPLATE: ClassVar[str] = "chat_template.jinja"
    TOKENIZER_CONFIG: ClassVar[str] = "tokenizer_config.json"
    CHECKPOINTS_FACT: ClassVar[str] = "checkpoints"  # the key of run.json naming the checkpoint folder

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    # Files and folders at the top.
    @property
    def config(self) -> Path:
        return self.path / self.CONFIG

    @property
    def run_facts(self) -> Path:
        return self.path / self.RUN_FACTS

    @property
    def summary(self) -> Path:
        return self.path / self.SUMMARY

    @property
    def metrics(self) -> Path:
        return self.path / self.METRICS

    @property
    def restarts(self) -> Path:
        return self.path / self.RESTARTS

    @property
    def guard(self) -> Path:
        return self.path / self.GUARD

    @property
    def preemption(self) -> Path:
        return self.path / self.PREEMPTION

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def run_id_file(self) -> Path:
        return self.path / self.RUN_ID

    @property
    def report(self) -> Path:
        return self.path / self.REPORT

    @property
    def prometheus(self) -> Path:
        return self.path / self.PROMETHEUS

    @property
    def tensorboard(self) -> Path:
        return self.path / self.TENSORBOARD

    @property
    def wandb(self) -> Path:
        return self.path / self.WANDB

    @property
    def tokenizer(self) -> Path:
        return self.path / self.TOKENIZER

    # Under logs/: what each rank and the elastic agent leave.
    @property
    def logs(self) -> Path:
        return self.path / self.LOGS

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    @property
    def agent_log(self) -> Path:
        return self.logs / self.AGENT_LOG

    def rank_preemption(self, rank: int) -> Path:
        """A rank's copy of the preemption record (for the launcher of a node without rank 0)."""
        return self.logs / f"preemption-rank{rank}.json"

    @property
    def failures(self) -> Path:
        return self.logs / self.FAILURES

    def failure_record(self, restart: int, rank: int) -> Path:
        """One record per rank and attempt of the elastic agent."""
        return self.failures / f"restart{restart}-rank{rank}.json"

    def failure_records(self, restart: int) -> list[Path]:
        return list(self.failures.glob(f"restart{restart}-rank*.json"))

    def bad_input_record(self, rank: int) -> Path:
        return self.failures / f"bad-input-rank{rank}.json"

    def bad_input_records(self) -> list[Path]:
        return list(self.failures.glob("bad-input-rank*.json"))

    # Under hang/: the watchdog's dumps.
    @property
    def hang(self) -> Path:
        return self.path / self.HANG

    @property
    def profile(self) -> Path:
        return self.path / self.PROFILE

    def hang_stacks(self, rank: int) -> Path:
        return self.hang / f"rank{rank}.txt"

    def hang_report(self, rank: int) -> Path:
        return self.hang / f"report-rank{rank}.json"

    # Records read or written by more than one module.
    def write_run_facts(self, facts: dict[str, Any]) -> None:
        self.run_facts.write_text(json.dumps(facts, indent=2))

    def read_run_facts(self) -> dict[str, Any]:
        """The run's facts; empty when it recorded none."""
        return json.loads(self.run_facts.read_text()) if self.run_facts.exists() else {}

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.summary.write_text(json.dumps(summary, indent=2))

    def read_summary(self) -> dict[str, Any]:
        return json.loads(self.summary.read_text())

    def append_restart(self, entry: dict[str, Any]) -> None:
        with self.restarts.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")

    def read_restarts(self) -> list[dict[str, Any]]:
        """Every restart or resume recorded, oldest first; empty when there was none."""
        if not self.restarts.exists():
            return []
        return [json.loads(line) for line in self.restarts.read_text().splitlines() if line.strip()]

    def read_guard(self) -> list[dict[str, Any]]:
        """The spike and NaN guard's decisions (steps not kept, rollbacks), oldest first;
        empty when it made none. A line still being written is left for a later read."""
        if not self.guard.exists():
            return []
        return [json.loads(line) for line in self.guard.read_text().splitlines(keepends=True)
                if line.strip() and line.endswith("\n")]

    def write_preemption(self, entry: dict[str, Any], rank: int | None = None) -> None:
        """``preemption.json`` (rank 0, ``rank`` None) or rank ``rank``'s copy under logs/."""
        path = self.preemption if rank is None else self.rank_preemption(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(entry, indent=2))

    def read_preemption(self, since: float = 0.0) -> dict[str, Any] | None:
        """The preemption recorded at ``since`` or later: rank 0's record, else one a rank
        of this node left in its logs (a node without rank 0); None when there is none."""
        for path in [self.preemption, *sorted(self.logs.glob("preemption-rank*.json"))]:
            try:
                if path.stat().st_mtime < since:
                    continue  # an older preemption
                return json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return None


class RunNaming(Protocol):
    """What names a run directory: the fields of ``config.sections.RunConfig`` it reads."""

    run_dir: str
    dir: str
    name: str


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def resolve_run_dir(cfg: RunNaming, job_id: str = "") -> Path:
    """``run.run_dir`` when given; ``<run.dir>/<run.name>-<job_id>`` for a job with an id
    (the same folder after a restart or a requeue, so the run resumes); else a new
    ``<run.dir>/<run.name>-<timestamp>`` folder."""
    if cfg.run_dir:
        return Path(cfg.run_dir).expanduser().resolve()
    if job_id:
        # An id may hold characters a folder name should not ('/', spaces).
        return Path(cfg.dir).expanduser().resolve() / f"{cfg.name}-{_UNSAFE.sub('-', job_id)}"
    base = Path(cfg.dir).expanduser().resolve() / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while candidate.exists():  # two runs started within the same second
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def run_id_of(run_dir: Path, job_id: str = "") -> str:
    """The id of the run living in ``run_dir`` (its checkpoints carry it): the one kept in
    the folder when there is one, so a run continued in place keeps its id; else, for a
    job with an id, one derived from the job and the folder's name, which every node
    derives alike even where nodes do not share the run directory; else a random one.
    A new id is kept in the folder. Call it on one rank (rank 0) and hand the answer on."""
    path = RunDir(run_dir).run_id_file
    if path.exists():
        return path.read_text().strip()
    value = derived_run_id(job_id, run_dir.name) if job_id else uuid.uuid4().hex[:12]
    path.write_text(value + "\n")
    return value


def derived_run_id(job_id: str, run_name: str) -> str:
    """A run id that depends only on the job and the run directory's name (12 hex digits,
    like a random one: it goes into file names)."""
    return hashlib.sha256(f"{job_id}\n{run_name}".encode()).hexdigest()[:12]

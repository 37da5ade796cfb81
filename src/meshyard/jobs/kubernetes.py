"""Kubernetes manifests of a meshyard job: a ConfigMap holding the resolved config, and a
Kubeflow PyTorchJob (training operator, ``kubeflow.org/v1``) or TrainJob (Kubeflow
Trainer, ``trainer.kubeflow.org/v1alpha1``) whose pods run ``meshyard run`` on it.

Pure building: plain dicts that ``meshyard.jobs.k8s_cli`` prints as YAML for
``kubectl apply``; nothing here talks to a cluster.

How a pod runs. Each pod is a node of the job: it runs one ``meshyard run`` agent, which
starts the pod's workers (one per GPU) and meets the other pods' agents at a rendezvous,
exactly as ``meshyard run --nnodes ...`` does on any node (``meshyard.launch.nodes``).
The alternative, one process per pod under the operator's own variables, holds only for
one GPU per pod: the training operator gives a Master/Worker pod ``RANK`` = the pod's node
rank and ``WORLD_SIZE`` = nodes x nprocPerNode, values meant for torchrun (which reads its
settings from ``PET_*``), and meshyard takes a process with ``RANK`` and ``WORLD_SIZE`` but
no ``LOCAL_RANK`` for a rank of a one-process-per-pod job
(``runtime.environment.detect_environment``). So the pod's command removes those two
variables (``env -u``), takes the node rank and the rendezvous address from the
operator's variables (the kubelet expands ``$(PET_NODE_RANK)`` in a command), and reads
the job's shape (``run.nnodes``, ``run.nproc``, ``run.rdzv_id`` = the job's name, which
names the run directory, so a restarted pod resumes there) from the mounted config.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Callable

import fsspec

from meshyard.config.checks import node_range
from meshyard.config.dump import config_to_toml
from meshyard.config.load import ConfigError, did_you_mean
from meshyard.config.sections import CheckpointConfig, Config, RunConfig
from meshyard.run_dir import RunDir
from meshyard.runtime.devices import CPU_DEFAULT_NPROC
from meshyard.validate import derive_layout, validate

KINDS = ("pytorchjob", "trainjob")
"""What ``--kind`` may name: a Kubeflow PyTorchJob (v1) or a Kubeflow Trainer TrainJob (v2)."""
CONFIG_DIR = "/etc/meshyard"
CONFIG_KEY = RunDir.CONFIG  # the pod's config file is named as a run directory's
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GPU_RESOURCE = "nvidia.com/gpu"
CHECKPOINT_VOLUME = RunDir.CHECKPOINTS  # the volume mounted where the checkpoints go
# The training operator finds the container and its port by these names; 23456 is its default port.
PYTORCH_CONTAINER = "pytorch"
PYTORCH_PORT_NAME = "pytorchjob-port"
PYTORCH_PORT = 23456
# Kubeflow Trainer's torch runtimes run the nodes as the replicated job "node" (container "node")
# and serve the rendezvous on port 29400 of its first pod.
TRAINJOB_RUNTIME = "torch-distributed"
TRAINJOB_NODE = "node"
TRAINJOB_PORT = 29400
NAME_LIMIT = 40
"""Longest job name: Kubernetes derives pod, service and host names from it (``<name>-worker-12``),
which must stay within 63 characters."""

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class ManifestRequest:
    """What ``meshyard k8s manifest`` is asked for; empty strings leave the cluster's defaults."""

    image: str
    nodes: str = "1"
    """``"N"``, or ``"MIN:MAX"`` for an elastic job (PyTorchJob only)."""
    gpus_per_node: int = 0
    kind: str = "pytorchjob"
    namespace: str = ""
    checkpoint_pvc: str = ""
    """A PersistentVolumeClaim (ReadWriteMany for several pods) mounted where the checkpoints go."""
    storage_secret: str = ""
    """A Secret whose entries become the pods' environment: object-storage credentials."""
    queue: str = ""
    name: str = ""
    """The job's name; empty: ``run.name`` made into a valid Kubernetes name."""
    placement: tuple[str, ...] = ()
    """Node names chosen by ``meshyard place``: the pods are kept to them (node affinity)."""


@dataclass(frozen=True)
class PodJob:
    """A checked request: the job's shape, and the config its pods run."""

    name: str
    min_nodes: int
    max_nodes: int
    nproc: int
    gpus_per_node: int
    volume_path: str
    """Where the checkpoint volume is mounted ("" when none is)."""
    config: Config
    """The resolved config as the ConfigMap holds it."""

    @property
    def elastic(self) -> bool:
        """Nodes may leave and join (``MIN:MAX``): a PyTorchJob with an elastic policy."""
        return self.min_nodes != self.max_nodes


def manifests(config: Config, request: ManifestRequest, earlier_problems: list[str] | None = None
              ) -> list[dict[str, Any]]:
    """The ConfigMap and the job that run ``config`` as ``request`` asks, as plain dicts.

    Raises one ``ConfigError`` listing every problem: ``earlier_problems`` (found while
    loading the config), the request's own, and the config's for the job's world size
    (``meshyard.validate``: the layout must fit nodes x workers per node, at every node
    count of an elastic range).
    """
    job = plan_job(config, request, earlier_problems or [])
    return [config_map(job, request), JOB_BUILDERS[request.kind](job, request)]


def plan_job(config: Config, request: ManifestRequest, earlier_problems: list[str]) -> PodJob:
    """Check ``request`` and ``config`` together; the job to write, or ``ConfigError``."""
    problems = [*earlier_problems, *request_problems(config.run, request)]
    bounds = node_range(request.nodes)
    if bounds is None or request.gpus_per_node < 0:
        raise ConfigError(problems, "Kubernetes job")  # no world size to check the layout at
    low, high = bounds
    name = request.name or default_name(config.run.name)
    nproc = request.gpus_per_node or config.run.nproc or CPU_DEFAULT_NPROC
    volume_path, storage_problems = storage_plan(config.checkpoint, config.run, request, high)
    problems += storage_problems
    nnodes = f"{low}" if low == high else f"{low}:{high}"
    run = dataclasses.replace(config.run, nnodes=nnodes, nproc=nproc, rdzv_id=name, rdzv_endpoint="", node_rank=-1)
    resolved = dataclasses.replace(config, run=run)
    # The pods get the endpoint on their command line; the layout is checked with the one they will get.
    endpoint = _endpoint(request.kind, name, elastic=low != high)
    checked = dataclasses.replace(resolved, run=dataclasses.replace(run, rdzv_endpoint=endpoint))
    validate(checked, high * nproc, problems)  # raises with every problem, the request's included
    unfit = [f"with {count} node(s) ({count * nproc} ranks): {problem}"
             for count in range(low, high) for problem in _layout_problems(checked, count * nproc)]
    if unfit:
        raise ConfigError([f"--nodes {request.nodes} lets the job run on fewer nodes, where its layout does not "
                           "fit; narrow the range or change the layout", *unfit], "Kubernetes job")
    return PodJob(name, low, high, nproc, request.gpus_per_node, volume_path, resolved)


def _layout_problems(config: Config, world_size: int) -> list[str]:
    try:
        derive_layout(config, world_size)
    except ConfigError as exc:
        return exc.problems
    return []


def _endpoint(kind: str, name: str, elastic: bool) -> str:
    """The rendezvous address the operator will give the pods (its naming of the first pod)."""
    if kind == "trainjob":
        return f"{name}-{TRAINJOB_NODE}-0-0.{name}:{TRAINJOB_PORT}"
    return f"{name}-{'worker' if elastic else 'master'}-0:{PYTORCH_PORT}"


def default_name(run_name: str) -> str:
    """``run.name`` as a Kubernetes job name: lower case, letters, digits and '-', starting
    with a letter, at most ``NAME_LIMIT`` characters; "meshyard" when nothing is left."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_name.lower())
    name = re.sub(r"^[^a-z]+", "", name)[:NAME_LIMIT].rstrip("-")
    return name or "meshyard"


def request_problems(run: RunConfig, request: ManifestRequest) -> list[str]:
    """What makes ``request`` unusable for a config's ``[run]``, each with its fix (the
    storage aside: ``storage_plan``); empty when fine."""
    gpus, device = request.gpus_per_node, run.device
    bounds = node_range(request.nodes)
    checks = [
        (bool(request.image.strip()) and not re.search(r"\s", request.image),
         f"--image {request.image!r}: a manifest needs the container image every pod runs, with meshyard (the "
         "'meshyard' command) and your code installed, e.g. --image registry.example.com/team/train:1.0"),
        (request.kind in KINDS, f"--kind {request.kind!r} is not known{did_you_mean(request.kind, KINDS)}; known: "
         "pytorchjob (Kubeflow training operator, kubeflow.org/v1), trainjob (Kubeflow Trainer, "
         "trainer.kubeflow.org/v1alpha1)"),
        (bounds is not None, f"--nodes {request.nodes!r} is neither a node count of at least 1 ('2') nor a range "
         "MIN:MAX of them ('2:4')"),
        (not (request.kind == "trainjob" and bounds is not None and bounds[0] != bounds[1]),
         f"--nodes {request.nodes} is an elastic range, which a TrainJob cannot run: Kubeflow Trainer has no "
         f"elastic policy; use --kind pytorchjob for a range, or a fixed count (--nodes {(bounds or (1, 1))[1]})"),
        (gpus >= 0, f"--gpus-per-node {gpus} must not be negative (0: a CPU job)"),
        (not (gpus > 0 and device == "cpu"),
         f"--gpus-per-node {gpus} asks for GPUs but the config runs on the CPU (run.device = 'cpu'): drop "
         "--gpus-per-node, or set --run.device=auto or cuda"),
        (not (gpus == 0 and device == "cuda"),
         "the config runs on CUDA (run.device = 'cuda') but no GPUs are asked for: add --gpus-per-node G"),
        (gpus <= 0 or run.nproc in (0, gpus),
         f"run.nproc = {run.nproc} but --gpus-per-node {gpus}: each pod starts one worker per GPU; "
         f"leave run.nproc at 0 or set it to {gpus}"),
    ]
    return [message for ok, message in checks if not ok] + _name_problems(request) + _placement_problems(request)


def _placement_problems(request: ManifestRequest) -> list[str]:
    """A placement that the job cannot follow."""
    if not request.placement:
        return []
    bounds = node_range(request.nodes) or (1, 1)
    if request.kind == "trainjob":
        return ["--placement: a TrainJob's pod overrides take no node affinity (Kubeflow Trainer offers only a "
                "nodeSelector); use --kind pytorchjob, or label the chosen nodes and select them in the runtime"]
    if len(set(request.placement)) < bounds[1]:
        return [f"--placement names {len(set(request.placement))} node(s) but --nodes {request.nodes} needs room "
                f"for {bounds[1]} pods; run 'meshyard place --json' for as many nodes, or lower --nodes"]
    return []


def node_affinity(names: tuple[str, ...]) -> dict[str, Any]:
    """A pod's ``affinity`` keeping it to the nodes ``names`` (their hostname label)."""
    term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": list(names)}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def _name_problems(request: ManifestRequest) -> list[str]:
    """Names Kubernetes would refuse, found before ``kubectl apply`` does."""
    rules: list[tuple[str, str, re.Pattern[str], int, str]] = [
        ("--name", request.name, DNS1035, NAME_LIMIT, "lower-case letters, digits and '-', starting with a letter"),
        ("--namespace", request.namespace, DNS1123_LABEL, 63, "lower-case letters, digits and '-'"),
        ("--checkpoint-pvc", request.checkpoint_pvc, DNS1123_NAME, 253, "lower-case letters, digits, '-' and '.'"),
        ("--storage-secret", request.storage_secret, DNS1123_NAME, 253, "lower-case letters, digits, '-' and '.'"),
        ("--queue", request.queue, DNS1123_NAME, 63, "lower-case letters, digits, '-' and '.'"),
    ]
    return name_problems(rules)


def name_problems(rules: list[tuple[str, str, re.Pattern[str], int, str]]) -> list[str]:
    """One line per (flag, value, pattern, length limit, what is allowed) whose given value
    Kubernetes would refuse as a name."""
    return [f"{flag} {value!r} is not a valid Kubernetes name: use at most {limit} {allowed}, starting and "
            "ending with a letter or digit"
            for flag, value, pattern, limit, allowed in rules
            if value and (len(value) > limit or not pattern.match(value))]


def storage_plan(ckpt: CheckpointConfig, run: RunConfig, request: ManifestRequest,
                 max_nodes: int) -> tuple[str, list[str]]:
    """Where the checkpoint volume is mounted ("" for none), and the problems of the storage asked for.

    A volume goes where the checkpoints go: ``checkpoint.dir``, or the run directory that
    holds them while ``checkpoint.dir`` is empty (``run.run_dir``, else ``run.dir``, under
    which the job's run directory is made), so a restarted pod finds them there.
    """
    protocol, path = fsspec.core.split_protocol(ckpt.dir)
    local = protocol in (None, "file", "local")
    if request.checkpoint_pvc:
        if not local:
            return "", [f"--checkpoint-pvc {request.checkpoint_pvc} mounts a volume, but checkpoint.dir = "
                        f"'{ckpt.dir}' is object storage: drop --checkpoint-pvc (--storage-secret gives the pods "
                        "its credentials), or set checkpoint.dir to a path on the volume"]
        key, target = ("checkpoint.dir", path) if ckpt.dir else (
            ("run.run_dir", run.run_dir) if run.run_dir else ("run.dir", run.dir))
        if not posixpath.isabs(target):
            return "", [f"--checkpoint-pvc {request.checkpoint_pvc}: {key} = '{target}' is not an absolute path, "
                        "and the volume is mounted where the checkpoints go; set one, e.g. "
                        f"--{key}=/runs" + ("" if ckpt.dir else " (the run directories, checkpoints inside, "
                                            "then live on the volume)")]
        return posixpath.normpath(target), []
    if request.storage_secret and local:
        return "", [f"--storage-secret {request.storage_secret} passes object-storage credentials, but "
                    f"checkpoint.dir = '{ckpt.dir}' is not object storage; set checkpoint.dir = 's3://bucket/prefix', "
                    "or drop --storage-secret"]
    if max_nodes > 1 and ckpt.enabled and (local or protocol == "memory"):
        return "", [f"a job of {max_nodes} pods needs checkpoint storage every pod sees (each rank writes its own "
                    "shards into one folder), but checkpoint.dir = "
                    f"'{ckpt.dir or f'<run dir>/{RunDir.CHECKPOINTS}'}' is inside each pod: give --checkpoint-pvc NAME "
                    "(a ReadWriteMany PersistentVolumeClaim), or set checkpoint.dir = 's3://bucket/prefix' "
                    "(with --storage-secret NAME for its credentials)"]
    return "", []


def config_map(job: PodJob, request: ManifestRequest) -> dict[str, Any]:
    """The ConfigMap holding the resolved config (credentials redacted: the pods take them
    from their environment, e.g. ``--storage-secret``)."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(f"{job.name}-config", request, queue=False),
            "data": {CONFIG_KEY: config_to_toml(job.config)}}


def _metadata(name: str, request: ManifestRequest, queue: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if request.namespace:
        meta["namespace"] = request.namespace
    if queue and request.queue:
        meta["labels"] = {QUEUE_LABEL: request.queue}  # Kueue admits the job through this LocalQueue
    return meta


def pod_command(job: PodJob, kind: str) -> list[str]:
    """The command of every pod: one meshyard agent for the pod's workers (see the module's
    docstring). ``$(VAR)`` is expanded by the kubelet from the variables the operator sets."""
    run = ["meshyard", "run", CONFIG_PATH]
    if kind == "trainjob":  # Trainer sets only PET_* variables: nothing to remove
        rendezvous = ["--node-rank", "$(PET_NODE_RANK)", "--rdzv-endpoint", "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"]
        return run + (rendezvous if job.max_nodes > 1 else [])
    if job.elastic:  # Worker pods only: no RANK/WORLD_SIZE; the first worker serves the rendezvous
        return run + ["--rdzv-endpoint", "$(PET_RDZV_ENDPOINT)"]
    # The operator's RANK (the pod's node rank) and WORLD_SIZE would make meshyard take the
    # pod for a single rank; the node rank goes to the agent instead.
    rendezvous = ["--node-rank", "$(PET_NODE_RANK)", "--rdzv-endpoint", "$(MASTER_ADDR):$(MASTER_PORT)"]
    return ["env", "-u", "RANK", "-u", "WORLD_SIZE", *run, *(rendezvous if job.max_nodes > 1 else [])]


def _volumes(job: PodJob, request: ManifestRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pods' volumes and the container's mounts of them: the config, a memory-backed
    /dev/shm (the container runtime's 64 MB default starves data-loader workers and NCCL),
    and the checkpoint volume."""
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{job.name}-config"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if job.volume_path:
        volumes.append({"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": request.checkpoint_pvc}})
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": job.volume_path})
    return volumes, mounts


def _env_from(request: ManifestRequest) -> list[dict[str, Any]]:
    """The storage Secret's entries as environment variables (AWS_ACCESS_KEY_ID, ...),
    where fsspec's backends look for credentials."""
    return [{"secretRef": {"name": request.storage_secret}}] if request.storage_secret else []


def _resources(job: PodJob) -> dict[str, Any]:
    return {"limits": {GPU_RESOURCE: job.gpus_per_node}} if job.gpus_per_node else {}


def pytorch_job(job: PodJob, request: ManifestRequest) -> dict[str, Any]:
    """A Kubeflow PyTorchJob: a Master and N-1 Workers, or for an elastic range only
    Workers (up to MAX) meeting at the first Worker; a failed pod is restarted up to
    ``fault.max_restarts`` times (``runPolicy.backoffLimit``)."""
    template = _pytorch_pod(job, request)
    replica = {"restartPolicy": "OnFailure", "template": template}
    if job.elastic:
        replicas = {"Worker": {"replicas": job.max_nodes, **replica}}
    else:
        replicas = {"Master": {"replicas": 1, **replica}}
        if job.max_nodes > 1:
            replicas["Worker"] = {"replicas": job.max_nodes - 1, **replica}
    restarts = job.config.fault.max_restarts
    spec: dict[str, Any] = {"nprocPerNode": str(job.nproc), "runPolicy": {"backoffLimit": restarts}}
    if job.elastic:
        # The worker count goes in spec.nprocPerNode only: the operator refuses the deprecated
        # elasticPolicy.nProcPerNode beside it.
        spec["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": job.min_nodes, "maxReplicas": job.max_nodes,
                                 "maxRestarts": restarts}
    spec["pytorchReplicaSpecs"] = replicas
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(job.name, request),
            "spec": spec}


def _pytorch_pod(job: PodJob, request: ManifestRequest) -> dict[str, Any]:
    volumes, mounts = _volumes(job, request)
    container: dict[str, Any] = {
        "name": PYTORCH_CONTAINER,
        "image": request.image,
        "command": pod_command(job, "pytorchjob"),
        # The operator reads the rendezvous port from this named port (MASTER_PORT, PET_RDZV_ENDPOINT).
        "ports": [{"name": PYTORCH_PORT_NAME, "containerPort": PYTORCH_PORT}],
    }
    if job.gpus_per_node:
        container["resources"] = _resources(job)
    if request.storage_secret:
        container["envFrom"] = _env_from(request)
    container["volumeMounts"] = mounts
    spec: dict[str, Any] = {"containers": [container], "volumes": volumes}
    if request.placement:
        spec["affinity"] = node_affinity(request.placement)
    return {"spec": spec}


def train_job(job: PodJob, request: ManifestRequest) -> dict[str, Any]:
    """A Kubeflow Trainer TrainJob on the ``torch-distributed`` runtime: ``numNodes`` pods
    of ``numProcPerNode`` workers; volumes and the storage Secret reach the node pods
    through ``podSpecOverrides``."""
    trainer: dict[str, Any] = {"image": request.image, "command": pod_command(job, "trainjob"),
                               "numNodes": job.max_nodes, "numProcPerNode": job.nproc}
    if job.gpus_per_node:
        trainer["resourcesPerNode"] = _resources(job)
    volumes, mounts = _volumes(job, request)
    container: dict[str, Any] = {"name": TRAINJOB_NODE, "volumeMounts": mounts}
    if request.storage_secret:
        container["envFrom"] = _env_from(request)
    override = {"targetJobs": [{"name": TRAINJOB_NODE}], "volumes": volumes, "containers": [container]}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _metadata(job.name, request),
            "spec": {"runtimeRef": {"name": TRAINJOB_RUNTIME}, "trainer": trainer, "podSpecOverrides": [override]}}


JOB_BUILDERS: dict[str, Callable[[PodJob, ManifestRequest], dict[str, Any]]] = {
    "pytorchjob": pytorch_job,
    "trainjob": train_job,
}
"""``--kind`` -> the builder of its job."""

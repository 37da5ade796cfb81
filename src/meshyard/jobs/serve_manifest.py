"""Kubernetes manifests that serve a trained run: a Deployment of ``meshyard serve`` pods,
a ClusterIP Service in front of them, and a HorizontalPodAutoscaler (``autoscaling/v2``).

Pure building, like ``meshyard.jobs.kubernetes``: plain dicts that
``meshyard.jobs.k8s_cli`` prints for ``kubectl apply``. Only ``read_run`` (the run's
config.toml) and ``checkpoint_size`` (its newest checkpoint's metadata) read files; nothing
talks to a cluster.

How the pods scale. Each pod runs one server whose gauge
``meshyard_serve_in_flight_requests`` counts the requests it holds. The autoscaler keeps its
average per pod at ``--target-in-flight`` (by default the server's ``serve.max_batch_size``:
above one full batch per pod, requests start to queue). The gauge reaches the autoscaler
through a custom-metrics adapter (e.g. prometheus-adapter, which also finds the pods by the
scrape annotations here); where no adapter serves it, the HPA still scales up on CPU
utilization, the second metric, and only holds back scaling down. A scale-down
stabilization window keeps a short lull from dropping pods that then load their model again.

The pods read the run's config and weights from the model volume (``--model-pvc``, mounted
read-only) or from the image, at the run directory's path as given. ``meshyard serve`` takes
its settings from ``--serve.*`` overrides only (never from the run's ``[serve]`` section), so
the overrides given here are what the pods run with, and the manifest is sized by them.
"""

from __future__ import annotations

import math
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from meshyard.config.checks import field_problems
from meshyard.config.load import ConfigError, collect_config, parse_override
from meshyard.config.sections import CheckpointConfig, Config, RunConfig, ServeConfig
from meshyard.jobs.kubernetes import (DNS1035, DNS1123_LABEL, DNS1123_NAME, GPU_RESOURCE, NAME_LIMIT, default_name,
                                       name_problems)
from meshyard.run_dir import RunDir

CONTAINER = "serve"
PORT_NAME = "http"
MODEL_MOUNT = "/models"
IN_FLIGHT_METRIC = "meshyard_serve_in_flight_requests"
SCALE_DOWN_WINDOW_S = 300
"""Seconds of lower load before pods are removed: a pod removed too early is a model loaded again."""
DRAIN_S = 5
"""Seconds a stopping pod keeps serving while the Service stops sending it new requests."""
START_BUDGET_S = 300
"""Seconds a pod may take to start its server (interpreter, torch, CUDA) before it is restarted."""
# Memory of a pod besides its models: the interpreter, torch and the server stack take about
# 320 MiB of resident memory on CPU (measured with torch 2.13); a CUDA context maps its
# libraries into host memory too, which takes more (an estimate, not measured here).
BASE_MEMORY_CPU = 512 * 2**20
BASE_MEMORY_GPU = 2 * 2**30
MEMORY_STEP = 64 * 2**20
DEFAULT_CPU = "2"
SERVE_FLAG = "--serve."
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


@dataclass(frozen=True)
class ServeRequest:
    """What ``meshyard k8s serve-manifest`` is asked for; empty values take the defaults named."""

    run_dir: str
    """The run directory (config.toml and checkpoints) as given: in the pod when no --model-pvc."""
    image: str
    name: str = ""
    """Names the Deployment, Service and HPA; empty: ``run.name`` made a valid Kubernetes name."""
    namespace: str = ""
    replicas: int | None = None
    """Pods on the first apply; None leaves the count to the autoscaler (re-applying then never resets it)."""
    min_replicas: int = 1
    max_replicas: int = 4
    target_in_flight: float = 0.0
    """Average in-flight requests per pod to scale at; 0: ``serve.max_batch_size``."""
    cpu_target: int = 70
    """Average CPU utilization (percent of the CPU request) to scale at, where the in-flight metric is missing."""
    model_pvc: str = ""
    model_path: str = ""
    """The run directory inside the volume; empty: the run directory's own name."""
    port: int = 0
    """0: ``serve.port``."""
    gpus: int = 0
    cpu: str = ""
    memory: str = ""
    """Empty: sized from the model's bytes (``memory_for``)."""
    serve_overrides: tuple[str, ...] = ()
    """``--serve.FIELD=VALUE`` settings of the pods' server."""


@dataclass(frozen=True)
class ServePlan:
    """A checked request: what the three objects are built from."""

    name: str
    port: int
    command: list[str]
    resources: dict[str, Any]
    target: str
    grace_s: int


def read_run(request: ServeRequest) -> tuple[Config, ServeConfig, list[str]]:
    """The run's config, the server's settings (defaults < ``--serve.*`` overrides, as
    ``meshyard serve`` resolves them) and every problem met reading them."""
    serve, problems = collect_config(None, request.serve_overrides)
    # The ranges 'meshyard serve' checks, refused here rather than by every pod at its start.
    problems += [problem for problem in field_problems(serve) if problem.startswith("serve.")]
    problems += _override_problems(request.serve_overrides)
    config_file = RunDir(request.run_dir).config
    if not config_file.is_file():
        missing = ("does not exist" if not Path(request.run_dir).exists()
                   else f"is not a run directory: it holds no {RunDir.CONFIG}")
        return Config(), serve.serve, [
            f"RUN {request.run_dir!r} {missing}; give the run directory that 'meshyard run' wrote "
            f"(<run.dir>/<run.name>-<id>, with {RunDir.CONFIG} and {RunDir.CHECKPOINTS}/)", *problems]
    config, run_problems = collect_config(config_file)
    return config, serve.serve, [*run_problems, *problems]


def _override_problems(overrides: tuple[str, ...]) -> list[str]:
    problems = []
    for text in overrides:
        if not text.startswith(SERVE_FLAG):
            problems.append(f"{text}: serve-manifest takes only --serve.FIELD=VALUE overrides, the settings of the "
                            f"pods' server; the rest of the config is the run's own (its {RunDir.CONFIG})")
        elif text.startswith(f"{SERVE_FLAG}host"):
            problems.append(f"{text}: the pods bind 0.0.0.0 so that the Service reaches them; drop it")
    return problems


class CheckpointSize(NamedTuple):
    """Bytes of a checkpoint's tensors, from its DCP metadata."""

    model: int
    """The model's tensors (tied ones twice: the checkpoint holds both names)."""
    read: int
    """Every tensor a load reads: ``checkpoint.tools.model_state`` reads the model's entries only."""


def checkpoint_size(run_dir: str, checkpoint: CheckpointConfig) -> CheckpointSize:
    """The tensors of the run's newest valid checkpoint, read from its DCP metadata (shapes
    and dtypes; no tensor is loaded). Raises ``ConfigError`` naming the fix."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from meshyard.checkpoint.locate import LocationError, locate

    skipped: list[str] = []
    try:
        ref = locate(run_dir, dict(checkpoint.storage_options), report=skipped.append)
        store = ref.store()
        entries = store.dcp_reader(store.path(ref.name)).read_metadata().state_dict_metadata
    except (LocationError, OSError, ValueError) as exc:
        raise ConfigError([f"the model's size cannot be read from RUN ({exc}{'; ' if skipped else ''}"
                           f"{'; '.join(skipped)}): give --memory M (e.g. --memory 8Gi), or a run directory "
                           "with a valid checkpoint"], "serving manifest") from None
    sizes = {key: math.prod(meta.size) * meta.properties.dtype.itemsize for key, meta in entries.items()
             if isinstance(meta, TensorStorageMetadata)}
    model = sum(size for key, size in sizes.items() if key.startswith("model."))
    return CheckpointSize(model, model)


def memory_for(size: CheckpointSize, serve: ServeConfig, gpus: int) -> str:
    """The memory a pod asks for: its base (``BASE_MEMORY_*``), what the model cache may hold
    (the model, or ``serve.memory_budget_bytes`` when larger), and what loading the model
    reads from its checkpoint beside it; rounded up to ``MEMORY_STEP``."""
    base = BASE_MEMORY_GPU if gpus else BASE_MEMORY_CPU
    total = base + max(size.model, serve.memory_budget_bytes) + size.read
    return f"{math.ceil(total / MEMORY_STEP) * MEMORY_STEP // 2**20}Mi"


def quantity(value: float) -> str:
    """``value`` as a Kubernetes quantity: whole numbers as they are, others in thousandths."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def serve_manifests(request: ServeRequest) -> list[dict[str, Any]]:
    """The Deployment, Service and HorizontalPodAutoscaler that serve ``request.run_dir``.

    Reads the run's config and, unless ``--memory`` is given, its newest checkpoint's
    metadata; raises one ``ConfigError`` listing every problem."""
    config, serve, problems = read_run(request)
    problems += request_problems(config.run, serve, request)
    if problems:
        raise ConfigError(problems, "serving manifest")
    size = CheckpointSize(0, 0) if request.memory else checkpoint_size(request.run_dir, config.checkpoint)
    return build(plan(config.run, serve, request, size), request)


def request_problems(run: RunConfig, serve: ServeConfig, request: ServeRequest) -> list[str]:
    """What makes ``request`` unusable, each with its fix; empty when fine."""
    low, high, start = request.min_replicas, request.max_replicas, request.replicas
    checks = [
        (bool(request.image.strip()) and not re.search(r"\s", request.image),
         f"--image {request.image!r}: a manifest needs the container image the pods run, with meshyard (the "
         "'meshyard' command) installed, e.g. --image registry.example.com/team/serve:1.0"),
        (low >= 1, f"--min-replicas {low} must be at least 1"),
        (high >= low, f"--min-replicas {low} is above --max-replicas {high}; lower the first or raise the second"),
        (start is None or low <= start <= high,
         f"--replicas {start} lies outside --min-replicas {low} .. --max-replicas {high}, where the autoscaler would "
         "move it at once; give a count in that range, or leave --replicas out"),
        (request.target_in_flight >= 0, f"--target-in-flight {request.target_in_flight} must not be negative (the "
         "in-flight requests per pod to scale at; 0 or left out: serve.max_batch_size)"),
        (request.cpu_target > 0, f"--cpu-target {request.cpu_target} must be above 0 (percent of the CPU request)"),
        (request.gpus >= 0, f"--gpus {request.gpus} must not be negative (0: serve on the CPU)"),
        (not (request.gpus > 0 and run.device == "cpu"),
         f"--gpus {request.gpus} asks for GPUs but the run's config is CPU-only (run.device = 'cpu'): drop --gpus, "
         "or serve a run trained with run.device = 'auto' or 'cuda'"),
        (not (request.model_path and not request.model_pvc),
         f"--model-path {request.model_path!r} is a path inside --model-pvc, which is not given; add --model-pvc "
         "NAME, or drop --model-path to serve the run directory from the image"),
        (not (posixpath.isabs(request.model_path) or ".." in request.model_path.split("/")),
         f"--model-path {request.model_path!r} must be relative to the volume's root (e.g. runs/exp-1-42)"),
    ]
    return [message for ok, message in checks if not ok] + _port_problems(serve, request) + _name_problems(
        request) + _quantity_problems(request)


def _port_problems(serve: ServeConfig, request: ServeRequest) -> list[str]:
    if request.port and serve.port not in (ServeConfig().port, request.port):
        return [f"--port {request.port} and --serve.port={serve.port} disagree; give one of them"]
    port = request.port or serve.port
    return [] if 1 <= port <= 65535 else [f"port {port} is not a port a Service can name; give --port 1..65535"]


def _name_problems(request: ServeRequest) -> list[str]:
    """Names Kubernetes would refuse, found before ``kubectl apply`` does."""
    rules = [("--name", request.name, DNS1035, NAME_LIMIT, "lower-case letters, digits and '-', starting with a "
              "letter"), ("--namespace", request.namespace, DNS1123_LABEL, 63, "lower-case letters, digits and '-'"),
             ("--model-pvc", request.model_pvc, DNS1123_NAME, 253, "lower-case letters, digits, '-' and '.'")]
    return name_problems(rules)


def _quantity_problems(request: ServeRequest) -> list[str]:
    return [f"{flag} {value!r} is not a Kubernetes quantity: give a number with an optional unit, e.g. {example}"
            for flag, value, example in (("--cpu", request.cpu, "4 or 500m"), ("--memory", request.memory, "8Gi"))
            if value and not _QUANTITY.match(value)]


def plan(run: RunConfig, serve: ServeConfig, request: ServeRequest, size: CheckpointSize) -> ServePlan:
    """The checked request with its defaults filled in; ``size``: the checkpoint's (used
    when ``--memory`` is not given)."""
    port = request.port or serve.port
    cpu = request.cpu or (str(serve.threads) if serve.threads else DEFAULT_CPU)
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": request.memory or memory_for(
        size, serve, request.gpus)}}
    # Memory limited to the request: a pod that outgrows it is restarted instead of starving its
    # neighbours. No CPU limit: throttling a server adds latency to every request it holds.
    resources["limits"] = {"memory": resources["requests"]["memory"]}
    if request.gpus:
        resources["limits"][GPU_RESOURCE] = request.gpus
    return ServePlan(name=request.name or default_name(run.name), port=port,
                     command=pod_command(run, serve, request, port, cpu), resources=resources,
                     target=quantity(request.target_in_flight or serve.max_batch_size),
                     grace_s=DRAIN_S + math.ceil(serve.request_timeout_s) + DRAIN_S)


def model_path(request: ServeRequest) -> str:
    """Where the pod finds the run directory: on the model volume, or as given (in the image)."""
    if request.model_pvc:
        inside = request.model_path or Path(request.run_dir).resolve().name
        return posixpath.normpath(posixpath.join(MODEL_MOUNT, inside))
    return request.run_dir.rstrip("/") or "/"


def pod_command(run: RunConfig, serve: ServeConfig, request: ServeRequest, port: int, cpu: str) -> list[str]:
    """``meshyard serve`` on the run, reachable from the Service, its model pinned (loaded at
    start-up, so /readyz, the readiness probe, turns 200 only once the pod can answer), and
    the ``--serve.*`` overrides."""
    given = {parse_override(text)[1]: text for text in request.serve_overrides}
    command = ["meshyard", "serve", model_path(request), "--host", "0.0.0.0", "--port", str(port)]
    if "pinned" not in given:
        command += ["--pin", run.name]
    command += [text for field, text in given.items() if field not in ("host", "port")]
    if "threads" not in given and cpu.isdigit():
        # torch would start one thread per core of the node, not of the pod's share of it.
        command.append(f"--serve.threads={cpu}")
    return command


def build(plan: ServePlan, request: ServeRequest) -> list[dict[str, Any]]:
    """The Deployment, the Service and the HorizontalPodAutoscaler of ``plan``."""
    return [deployment(plan, request), service(plan, request), autoscaler(plan, request)]


def _labels(plan: ServePlan) -> dict[str, str]:
    """The pods' labels; the Service and the Deployment select them by these."""
    return {"app.kubernetes.io/name": plan.name, "app.kubernetes.io/component": "serve"}


def _metadata(plan: ServePlan, request: ServeRequest) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": plan.name}
    if request.namespace:
        meta["namespace"] = request.namespace
    meta["labels"] = {**_labels(plan), "app.kubernetes.io/part-of": "meshyard"}
    return meta


def deployment(plan: ServePlan, request: ServeRequest) -> dict[str, Any]:
    """The server's pods. A rolling update starts a new pod and waits for it to be ready
    before it stops an old one, so a new image or model never lowers the capacity."""
    spec: dict[str, Any] = {}
    if request.replicas is not None:
        spec["replicas"] = request.replicas
    spec["selector"] = {"matchLabels": _labels(plan)}
    spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(plan.port),
                   "prometheus.io/path": "/metrics"}
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": plan.grace_s, "containers": [_container(plan, request)]}
    if request.model_pvc:
        pod["volumes"] = [{"name": "model", "persistentVolumeClaim": {"claimName": request.model_pvc,
                                                                      "readOnly": True}}]
    spec["template"] = {"metadata": {"labels": _labels(plan), "annotations": annotations}, "spec": pod}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(plan, request), "spec": spec}


def _container(plan: ServePlan, request: ServeRequest) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": request.image,
        "command": plan.command,
        "ports": [{"name": PORT_NAME, "containerPort": plan.port, "protocol": "TCP"}],
        "resources": plan.resources,
        **_probes(),
        # The Service drops a stopping pod from its endpoints a moment after the pod is told to
        # stop; it keeps serving meanwhile, then finishes the requests it holds (the grace period).
        "lifecycle": {"preStop": {"sleep": {"seconds": DRAIN_S}}},
    }
    if request.model_pvc:
        container["volumeMounts"] = [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]
    return container


def _probes() -> dict[str, Any]:
    """Start-up: the process answers /healthz within ``START_BUDGET_S``. Readiness: /readyz,
    200 once the pinned model is loaded, so no request reaches a pod still loading it.
    Liveness: /healthz, a server that stopped answering is restarted."""
    def get(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": PORT_NAME}, "periodSeconds": period, "timeoutSeconds": timeout,
                "failureThreshold": failures}

    return {"startupProbe": get("/healthz", 5, START_BUDGET_S // 5, 2),
            "readinessProbe": get("/readyz", 5, 2, 2),
            "livenessProbe": get("/healthz", 10, 3, 5)}


def service(plan: ServePlan, request: ServeRequest) -> dict[str, Any]:
    """A ClusterIP Service on the server's port, to the ready pods only."""
    port = {"name": PORT_NAME, "port": plan.port, "targetPort": PORT_NAME, "protocol": "TCP"}
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(plan, request),
            "spec": {"type": "ClusterIP", "selector": _labels(plan), "ports": [port]}}


def autoscaler(plan: ServePlan, request: ServeRequest) -> dict[str, Any]:
    """Scales on in-flight requests per pod, CPU utilization beside it (see the module's
    docstring); up at once, down only after ``SCALE_DOWN_WINDOW_S`` of lower load, by half at most."""
    in_flight = {"type": "Pods", "pods": {"metric": {"name": IN_FLIGHT_METRIC},
                                          "target": {"type": "AverageValue", "averageValue": plan.target}}}
    cpu = {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                                      "averageUtilization": request.cpu_target}}}
    behavior = {
        "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
                    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15},
                                 {"type": "Pods", "value": 4, "periodSeconds": 15}]},
        "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S,
                      "policies": [{"type": "Percent", "value": 50, "periodSeconds": 60}]},
    }
    spec = {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": plan.name},
            "minReplicas": request.min_replicas, "maxReplicas": request.max_replicas,
            "metrics": [in_flight, cpu], "behavior": behavior}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _metadata(plan, request),
            "spec": spec}

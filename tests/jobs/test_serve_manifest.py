"""``meshyard k8s serve-manifest``: the Deployment, Service and HorizontalPodAutoscaler
validate against the Kubernetes 1.37 schemas (kubernetes-validate, strict: unknown fields
are errors), match the golden files, fit together (selectors, named ports, the scaled
Deployment), size the pods' memory from the model's bytes in a real trained run, and bad
requests are refused with exit code 2.

Regenerate the golden files after an intended change with
``python -m tests.launch.test_serve_manifest`` and read the diff.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import torch
import yaml

from meshyard.checkpoint.locate import locate
from meshyard.checkpoint.tools import model_state, read_full_state
from meshyard.cli import main
from meshyard.config.dump import config_to_toml
from meshyard.config.load import load_config
from meshyard.config.sections import ServeConfig
from meshyard.jobs.k8s_cli import to_yaml
from meshyard.jobs.serve_manifest import (IN_FLIGHT_METRIC, MODEL_MOUNT, SCALE_DOWN_WINDOW_S,
                                            CheckpointSize, ServeRequest, build, checkpoint_size, memory_for, plan,
                                            quantity, serve_manifests)
from tests.conftest import tiny_config
from tests.inprocess import fit_here

HERE = Path(__file__).resolve().parent / "k8s" / "serve"
KUBERNETES = "1.37"
IMAGE = "registry.example.com/team/serve:1.0"
BAD_INPUT = 2
MiB, GiB = 2**20, 2**30

# The golden cases are built without files: a fixed config, run path and checkpoint size.
GOLDEN: dict[str, tuple[list[str], ServeRequest, CheckpointSize]] = {
    "serve-cpu-image.yaml": (["--run.name=exp-1"], ServeRequest(
        run_dir="/srv/runs/exp-1-42", image=IMAGE, serve_overrides=("--serve.max_batch_size=32",)),
        CheckpointSize(model=1_234_567_890, read=3_703_703_670)),
    "serve-gpu-pvc.yaml": (["--run.name=Exp_2", "--run.device=cuda"], ServeRequest(
        run_dir="/home/me/runs/exp-2-7", image=IMAGE, name="chat", namespace="ml", replicas=2, min_replicas=2,
        max_replicas=10, target_in_flight=12, cpu_target=80, model_pvc="models", model_path="exp-2/exp-2-7",
        port=9000, gpus=1, cpu="8", memory="24Gi",
        serve_overrides=("--serve.cache=redis://redis.ml:6379/0", "--serve.request_timeout_s=60")),
        CheckpointSize(0, 0)),
}


def golden_documents(name: str) -> list[dict[str, Any]]:
    overrides, request, size = GOLDEN[name]
    config = load_config(None, overrides)
    serve = load_config(None, request.serve_overrides).serve
    return build(plan(config.run, serve, request, size), request)


def kubernetes_errors(document: dict[str, Any]) -> list[str]:
    """How ``document`` breaks the schema of its kind in Kubernetes 1.37 (strict), as 'path: message'."""
    try:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{'.'.join(map(str, error.path))}: {error.message}"]
    return []


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A real run directory: gpt-tiny trained 2 steps on one rank, its checkpoint and config.toml."""
    tmp = tmp_path_factory.mktemp("serve-run")
    cfg = tiny_config(tmp, "--checkpoint.enabled=true", "--train.steps=2", "--run.name=Demo_Run", "--run.nproc=1",
                      f"--run.run_dir={tmp / 'demo-run-7'}")
    fit_here(cfg)
    (tmp / "demo-run-7" / "config.toml").write_text(config_to_toml(cfg))
    return tmp / "demo-run-7"


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested state (dicts, lists)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["k8s", "serve-manifest", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- schemas and golden files


REQUESTS = [
    pytest.param([], ServeRequest(run_dir="runs/a", image=IMAGE), id="defaults"),
    pytest.param(["--run.device=cuda"], ServeRequest(run_dir="/r/a", image=IMAGE, gpus=8, memory="900Gi", cpu="500m",
                                                     target_in_flight=2.5), id="gpus-fractional-target"),
    pytest.param([], ServeRequest(run_dir="/r/a", image=IMAGE, model_pvc="m", replicas=1, min_replicas=1,
                                  max_replicas=1, namespace="ns", serve_overrides=("--serve.pinned=['x', 'y']",)),
                 id="pvc-fixed-size"),
    *(pytest.param(*GOLDEN[name][:2], id=name) for name in sorted(GOLDEN)),
]


@pytest.mark.parametrize("overrides, request_", REQUESTS)
def test_every_document_validates_against_the_kubernetes_schemas(overrides, request_):
    config, serve = load_config(None, overrides), load_config(None, request_.serve_overrides).serve
    documents = build(plan(config.run, serve, request_, CheckpointSize(GiB, 3 * GiB)), request_)
    assert [d["kind"] for d in documents] == ["Deployment", "Service", "HorizontalPodAutoscaler"]
    for document in documents:
        assert kubernetes_errors(document) == []
    # What kubectl reads is the printed text: it parses back to the same objects.
    assert list(yaml.safe_load_all(to_yaml(documents))) == documents


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_golden_files_validate_and_match_the_manifests(name):
    text = (HERE / name).read_text()
    for document in yaml.safe_load_all(text):
        assert kubernetes_errors(document) == []
    assert to_yaml(golden_documents(name)) == text


def test_the_schema_check_catches_wrong_types_unknown_fields_and_bad_values():
    deployment, service, hpa = golden_documents("serve-gpu-pvc.yaml")
    deployment["spec"]["replicas"] = "2"
    assert kubernetes_errors(deployment) == ["spec.replicas: '2' is not of type 'integer', 'null'"]
    deployment["spec"]["replicas"] = 2
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    assert "'httpGett' was unexpected" in kubernetes_errors(deployment)[0]
    service["spec"]["ports"][0]["port"] = "http"  # a Service's port is a number; only targetPort may be a name
    assert kubernetes_errors(service) == ["spec.ports.0.port: 'http' is not of type 'integer'"]
    del hpa["spec"]["maxReplicas"]
    assert kubernetes_errors(hpa) == ["spec: 'maxReplicas' is a required property"]


def write_goldens() -> None:
    """Rewrite the golden files from the current code (read the diff before committing it)."""
    HERE.mkdir(parents=True, exist_ok=True)
    for name in sorted(GOLDEN):
        (HERE / name).write_text(to_yaml(golden_documents(name)))
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    write_goldens()


# ---------------------------------------------------------------- the objects fit together


def test_the_service_and_the_autoscaler_reach_the_deployments_pods():
    deployment, service, hpa = golden_documents("serve-gpu-pvc.yaml")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["type"] == "ClusterIP"
    (port,) = service["spec"]["ports"]
    assert port["name"] == "http" and port["targetPort"] == container["ports"][0]["name"] == "http"
    assert port["port"] == container["ports"][0]["containerPort"] == 9000
    probes = {key: container[key]["httpGet"] for key in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes == {"startupProbe": {"path": "/healthz", "port": "http"},
                      "readinessProbe": {"path": "/readyz", "port": "http"},
                      "livenessProbe": {"path": "/healthz", "port": "http"}}
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "9000",
                                              "prometheus.io/path": "/metrics"}
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat"}
    assert {d["metadata"]["name"] for d in (deployment, service, hpa)} == {"chat"}
    assert {d["metadata"]["namespace"] for d in (deployment, service, hpa)} == {"ml"}
    # The pods end the requests they hold: drain, then at most one request timeout (60 s here).
    assert pod["spec"]["terminationGracePeriodSeconds"] == 5 + 60 + 5


def test_the_autoscaler_scales_on_in_flight_requests_with_cpu_as_the_fallback():
    hpa = golden_documents("serve-gpu-pvc.yaml")[2]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 10)
    in_flight, cpu = hpa["metrics"]
    assert in_flight == {"type": "Pods", "pods": {"metric": {"name": IN_FLIGHT_METRIC},
                                                  "target": {"type": "AverageValue", "averageValue": "12"}}}
    assert IN_FLIGHT_METRIC == "meshyard_serve_in_flight_requests"
    assert cpu == {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                                              "averageUtilization": 80}}}
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == SCALE_DOWN_WINDOW_S == 300
    assert hpa["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0
    # Without --target-in-flight a pod scales at one full batch of the server it runs.
    cpu_case = golden_documents("serve-cpu-image.yaml")[2]["spec"]
    assert cpu_case["metrics"][0]["pods"]["target"]["averageValue"] == "32"
    assert (cpu_case["minReplicas"], cpu_case["maxReplicas"]) == (1, 4)
    assert [quantity(v) for v in (16, 16.0, 2.5, 0.25)] == ["16", "16", "2500m", "250m"]


def test_the_replica_count_is_left_to_the_autoscaler_unless_given():
    assert "replicas" not in golden_documents("serve-cpu-image.yaml")[0]["spec"]
    assert golden_documents("serve-gpu-pvc.yaml")[0]["spec"]["replicas"] == 2


def test_the_model_volume_is_mounted_read_only_where_the_command_looks():
    deployment = golden_documents("serve-gpu-pvc.yaml")[0]["spec"]["template"]["spec"]
    container = deployment["containers"][0]
    assert deployment["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": "models",
                                                                                 "readOnly": True}}]
    assert container["volumeMounts"] == [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]
    assert container["command"] == [
        "meshyard", "serve", "/models/exp-2/exp-2-7", "--host", "0.0.0.0", "--port", "9000", "--pin", "Exp_2",
        "--serve.cache=redis://redis.ml:6379/0", "--serve.request_timeout_s=60", "--serve.threads=8"]
    assert container["resources"] == {"requests": {"cpu": "8", "memory": "24Gi"},
                                      "limits": {"memory": "24Gi", "nvidia.com/gpu": 1}}
    # Without a volume the image holds the run at the path given, and the pod mounts nothing.
    image = golden_documents("serve-cpu-image.yaml")[0]["spec"]["template"]["spec"]
    assert "volumes" not in image and "volumeMounts" not in image["containers"][0]
    assert image["containers"][0]["command"][:3] == ["meshyard", "serve", "/srv/runs/exp-1-42"]


def test_the_server_settings_given_are_the_pods_own():
    def command(request: ServeRequest) -> list[str]:
        serve = load_config(None, request.serve_overrides).serve
        return plan(load_config(None, ["--run.name=a"]).run, serve, request, CheckpointSize(0, 0)).command

    pinned = command(ServeRequest(run_dir="/r/a", image=IMAGE, cpu="500m",
                                  serve_overrides=("--serve.pinned=['a', 'b']", "--serve.port=8001")))
    assert pinned == ["meshyard", "serve", "/r/a", "--host", "0.0.0.0", "--port", "8001", "--serve.pinned=['a', 'b']"]
    threads = command(ServeRequest(run_dir="/r/a", image=IMAGE, cpu="4", serve_overrides=("--serve.threads=3",)))
    assert threads[-3:] == ["--pin", "a", "--serve.threads=3"]
    # The model path in the volume defaults to the run directory's own name.
    assert command(ServeRequest(run_dir="/r/exp-9/", image=IMAGE, model_pvc="m"))[2] == "/models/exp-9"


def test_memory_covers_the_base_what_the_cache_holds_and_one_load():
    default, size = ServeConfig(), CheckpointSize(model=GiB, read=3 * GiB)
    assert memory_for(size, default, gpus=0) == f"{512 + 1024 + 3072}Mi"
    assert memory_for(size, default, gpus=1) == f"{2048 + 1024 + 3072}Mi"
    budget = load_config(None, [f"--serve.memory_budget_bytes={4 * GiB}"]).serve
    assert memory_for(size, budget, gpus=0) == f"{512 + 4096 + 3072}Mi"
    assert memory_for(CheckpointSize(1, 1), default, gpus=0) == "576Mi"  # rounded up to 64 MiB
    assert memory_for(CheckpointSize(16 * MiB, 48 * MiB), default, gpus=0) == "576Mi"
    assert golden_documents("serve-cpu-image.yaml")[0]["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "2", "memory": "5248Mi"}, "limits": {"memory": "5248Mi"}}


# ---------------------------------------------------------------- a real trained run


def test_the_command_serves_a_trained_run_sized_from_its_checkpoint(trained_run, capsys):
    code, out, err = run_cli([str(trained_run), "--image", IMAGE, "--model-pvc", "runs", "--serve.max_batch_size=8"],
                             capsys)
    assert code == 0, err
    documents = list(yaml.safe_load_all(out))
    for document in documents:
        assert kubernetes_errors(document) == []
    config = load_config(trained_run / "config.toml")
    ref = locate(str(trained_run), {}, report=lambda message: None)
    size = checkpoint_size(str(trained_run), config.checkpoint)
    # What the metadata says is what loading reads: the model's tensors, and all of them.
    assert size.model == sum(t.numel() * t.element_size() for t in model_state(ref).values()) > 100_000
    read = sum(t.numel() * t.element_size() for t in tensors_in(read_full_state(ref, {"model"})))
    whole = sum(t.numel() * t.element_size() for t in tensors_in(read_full_state(ref)))
    assert size.read == read == size.model < whole / 2  # AdamW's two moments stay unread
    request = ServeRequest(run_dir=str(trained_run), image=IMAGE, model_pvc="runs",
                           serve_overrides=("--serve.max_batch_size=8",))
    assert out == to_yaml(build(plan(config.run, load_config(None, request.serve_overrides).serve, request, size),
                                request))
    deployment = documents[0]
    assert deployment["metadata"]["name"] == "demo-run"  # run.name made a Kubernetes name
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][2:] == ["/models/demo-run-7", "--host", "0.0.0.0", "--port", "8000", "--pin",
                                        "Demo_Run", "--serve.max_batch_size=8", "--serve.threads=2"]
    assert container["resources"]["requests"] == {"cpu": "2", "memory": memory_for(size, ServeConfig(), 0)}
    assert serve_manifests(request) == documents


def test_the_pods_command_serves_the_run_ready_on_its_probes(trained_run, tmp_path, capsys):
    """The container's command, run as a real server: the probes' paths answer 200 once the
    pinned model is loaded, and /metrics has the gauge the autoscaler reads."""
    import httpx

    from tests.serve.servers import running_servers

    code, out, err = run_cli([str(trained_run), "--image", IMAGE], capsys)
    assert code == 0, err
    container = list(yaml.safe_load_all(out))[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["meshyard", "serve"]
    args = container["command"][2:]
    args[args.index("--host") + 1] = "127.0.0.1"  # the test binds loopback; the pod binds every interface
    with running_servers(tmp_path, [args]) as (server,):  # started, and /readyz said 200
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            response = httpx.get(server.url + container[probe]["httpGet"]["path"], timeout=30.0)
            assert response.status_code == 200, server.explain(response)
        assert f"# TYPE {IN_FLIGHT_METRIC} gauge" in httpx.get(f"{server.url}/metrics", timeout=30.0).text
        assert server.metric(IN_FLIGHT_METRIC) == 0.0
        (model,) = httpx.get(f"{server.url}/v1/models", timeout=30.0).json()["models"]
    assert (model["name"], model["loaded"], model["pinned"]) == ("Demo_Run", True, True)
    # The size the memory is asked for by is no underestimate of what the server holds.
    run_config = load_config(trained_run / "config.toml")
    assert model["bytes"] <= checkpoint_size(str(trained_run), run_config.checkpoint).model


def test_a_run_without_a_checkpoint_needs_memory_given(tmp_path, capsys):
    run = tmp_path / "untrained"
    run.mkdir()
    (run / "config.toml").write_text(config_to_toml(load_config(None, [])))
    code, out, err = run_cli([str(run), "--image", IMAGE], capsys)
    assert code == BAD_INPUT and out == ""
    assert "the model's size cannot be read from RUN" in err and "give --memory M" in err
    code, out, err = run_cli([str(run), "--image", IMAGE, "--memory", "2Gi"], capsys)
    assert code == 0, err
    assert list(yaml.safe_load_all(out))[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"][
        "memory"] == "2Gi"


# ---------------------------------------------------------------- bad requests


@pytest.fixture
def cpu_run(tmp_path) -> Path:
    """A run directory whose config is CPU-only (config.toml only: the request is refused first)."""
    run = tmp_path / "cpu-run"
    run.mkdir()
    (run / "config.toml").write_text(config_to_toml(load_config(None, ["--run.device=cpu"])))
    return run


@pytest.mark.parametrize("argv, fragments", [
    pytest.param([], ["--image ''", "needs the container image"], id="no-image"),
    pytest.param(["--image", IMAGE, "--gpus", "1"], ["--gpus 1 asks for GPUs", "run.device = 'cpu'"],
                 id="gpus-on-a-cpu-run"),
    pytest.param(["--image", IMAGE, "--min-replicas", "5", "--max-replicas", "2"],
                 ["--min-replicas 5 is above --max-replicas 2"], id="min-above-max"),
    pytest.param(["--image", IMAGE, "--min-replicas", "0"], ["--min-replicas 0 must be at least 1"], id="zero-min"),
    pytest.param(["--image", IMAGE, "--replicas", "9"], ["--replicas 9 lies outside --min-replicas 1 .. "
                                                         "--max-replicas 4"], id="replicas-outside"),
    pytest.param(["--image", IMAGE, "--gpus", "-1"], ["--gpus -1 must not be negative"], id="negative-gpus"),
    pytest.param(["--image", IMAGE, "--target-in-flight", "-2"], ["--target-in-flight -2.0 must not be negative"],
                 id="negative-target"),
    pytest.param(["--image", IMAGE, "--cpu-target", "0"], ["--cpu-target 0 must be above 0"], id="zero-cpu-target"),
    pytest.param(["--image", IMAGE, "--model-path", "runs/a"], ["--model-path 'runs/a' is a path inside --model-pvc"],
                 id="path-without-pvc"),
    pytest.param(["--image", IMAGE, "--model-pvc", "m", "--model-path", "/runs/a"],
                 ["must be relative to the volume's root"], id="absolute-model-path"),
    pytest.param(["--image", IMAGE, "--name", "Chat_1"], ["--name 'Chat_1' is not a valid Kubernetes name"],
                 id="bad-name"),
    pytest.param(["--image", IMAGE, "--memory", "8GB"], ["--memory '8GB' is not a Kubernetes quantity"],
                 id="bad-memory"),
    pytest.param(["--image", IMAGE, "--port", "70000"], ["port 70000 is not a port a Service can name"],
                 id="bad-port"),
    pytest.param(["--image", IMAGE, "--port", "9000", "--serve.port=9001"], ["--port 9000 and --serve.port=9001"],
                 id="ports-disagree"),
    pytest.param(["--image", IMAGE, "--train.steps=5"], ["--train.steps=5: serve-manifest takes only --serve.FIELD"],
                 id="not-a-serve-override"),
    pytest.param(["--image", IMAGE, "--serve.host=127.0.0.1"], ["the pods bind 0.0.0.0"], id="serve-host"),
    pytest.param(["--image", IMAGE, "--serve.max_batch_size=0"], ["serve.max_batch_size = 0 must be at least 1"],
                 id="serve-setting-out-of-range"),
    pytest.param(["--image", IMAGE, "--serve.max_batch=4"], ["unknown key 'serve.max_batch'",
                                                             "did you mean 'max_batch_size'"], id="unknown-field"),
])
def test_bad_requests_exit_2_with_one_clear_message(argv, fragments, cpu_run, capsys):
    code, out, err = run_cli([str(cpu_run), *argv], capsys)
    assert code == BAD_INPUT, err
    assert out == ""  # nothing half-written for kubectl
    for fragment in fragments:
        assert fragment in err
    assert "Traceback" not in err


@pytest.mark.parametrize("make, fragment", [
    (lambda tmp: tmp / "nowhere", "does not exist"),
    (lambda tmp: tmp, "is not a run directory: it holds no config.toml"),
])
def test_a_missing_run_is_refused(make, fragment, tmp_path, capsys):
    code, out, err = run_cli([str(make(tmp_path)), "--image", IMAGE], capsys)
    assert code == BAD_INPUT and out == ""
    assert fragment in err and "give the run directory that 'meshyard run' wrote" in err


def test_every_problem_is_reported_at_once(cpu_run, capsys):
    code, _, err = run_cli([str(cpu_run), "--gpus", "2", "--min-replicas", "3", "--max-replicas", "1",
                            "--serve.max_batch_size=x"], capsys)
    assert code == BAD_INPUT
    for fragment in ("--image ''", "asks for GPUs", "--min-replicas 3 is above", "serve.max_batch_size = 'x'"):
        assert fragment in err


def test_without_pyyaml_the_command_names_the_k8s_extra(monkeypatch, cpu_run, capsys):
    monkeypatch.setitem(sys.modules, "yaml", None)
    code, out, err = run_cli([str(cpu_run), "--image", IMAGE], capsys)
    assert code == BAD_INPUT and out == ""
    assert "meshyard k8s serve-manifest needs the 'pyyaml' package" in err and "pip install 'meshyard[k8s]'" in err

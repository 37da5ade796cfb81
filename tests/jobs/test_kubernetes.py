"""``meshyard k8s manifest``: the manifests validate against the Kubeflow CRDs' schemas,
match the golden files, run meshyard the way the operators start pods, and bad requests
are refused with exit code 2.

The CRDs in tests/jobs/k8s are the published ones (PyTorchJob of the training operator
v1, TrainJob of Kubeflow Trainer v2). Their ``openAPIV3Schema`` is checked as JSON Schema
(Draft 7) the way ``kubectl apply`` (strict field validation) checks it: unknown fields are
errors, ``x-kubernetes-int-or-string`` takes an int or a string,
``x-kubernetes-preserve-unknown-fields`` keeps what it holds.

Regenerate the golden files after an intended change with
``python -m tests.launch.test_kubernetes`` and read the diff.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")

from meshyard.cli import build_parser, main, with_run_flags  # noqa: E402
from meshyard.config.dump import REDACTED, recorded_dict  # noqa: E402
from meshyard.config.load import ConfigError, group_override_tokens, load_config, tomllib  # noqa: E402
from meshyard.jobs.k8s_cli import to_yaml  # noqa: E402
from meshyard.jobs.kubernetes import (CONFIG_KEY, CONFIG_PATH, ManifestRequest, default_name,  # noqa: E402
                                        manifests)
from meshyard.runtime.environment import detect_environment  # noqa: E402
from meshyard.validate import validate  # noqa: E402

HERE = Path(__file__).resolve().parent / "k8s"
CRD_FILES = {"PyTorchJob": "kubeflow.org_pytorchjobs.yaml", "TrainJob": "trainer.kubeflow.org_trainjobs.yaml"}
IMAGE = "registry.example.com/team/train:1.0"
CONFIG_PLACEHOLDER = "<the resolved config.toml, checked on its own>"
BAD_INPUT = 2

# One fixed config for every manifest here: the built-in GPT, sharded.
BASE = ["--model.name=gpt-tiny", "--parallel.strategy=fsdp", "--train.global_batch=96", "--fault.max_restarts=3"]

GOLDEN: dict[str, tuple[list[str], ManifestRequest]] = {
    "pytorchjob-2x8.yaml": (["--run.dir=/runs"], ManifestRequest(
        image=IMAGE, nodes="2", gpus_per_node=8, name="exp-42", namespace="ml", checkpoint_pvc="ckpt",
        queue="team-a")),
    "pytorchjob-elastic-2to4x8.yaml": (["--checkpoint.dir=s3://bucket/ckpt"], ManifestRequest(
        image=IMAGE, nodes="2:4", gpus_per_node=8, name="exp-43", storage_secret="s3-credentials")),
    "trainjob-2x8.yaml": (["--checkpoint.dir=/checkpoints"], ManifestRequest(
        image=IMAGE, nodes="2", gpus_per_node=8, kind="trainjob", name="exp-44", checkpoint_pvc="ckpt",
        queue="team-a")),
}


def config_of(overrides: list[str]):
    return load_config(None, [*BASE, *overrides])


def golden_text(name: str) -> str:
    """The printed manifests of a golden case, the ConfigMap's config body set aside: that
    text is config/dump's, and it is compared by value in its own test."""
    overrides, request = GOLDEN[name]
    documents = manifests(config_of(overrides), request)
    documents[0]["data"][CONFIG_KEY] = CONFIG_PLACEHOLDER
    return to_yaml(documents)


# ---------------------------------------------------------------- CRD schemas as JSON Schema


def kubernetes_to_draft7(schema: Any) -> Any:
    """A CRD's structural schema as a Draft 7 JSON Schema with the API server's reading of
    the Kubernetes markers, and strict about unknown fields as ``kubectl apply`` is."""
    if isinstance(schema, list):
        return [kubernetes_to_draft7(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: kubernetes_to_draft7(value) for key, value in schema.items() if key != "properties"}
    if "properties" in schema:
        out["properties"] = {name: kubernetes_to_draft7(sub) for name, sub in schema["properties"].items()}
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    return out


def load_crd(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@pytest.fixture(scope="module")
def validators() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> a Draft 7 validator of each served version of each CRD."""
    found = {}
    for kind, file in CRD_FILES.items():
        crd = load_crd(HERE / file)
        assert crd["spec"]["names"]["kind"] == kind
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schema = kubernetes_to_draft7(version["schema"]["openAPIV3Schema"])
                jsonschema.Draft7Validator.check_schema(schema)
                found[(f"{crd['spec']['group']}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return found


METADATA = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "namespace": {"type": "string"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}
CONFIG_MAP = {"type": "object", "required": ["apiVersion", "kind", "metadata", "data"], "additionalProperties": False,
              "properties": {"apiVersion": {"const": "v1"}, "kind": {"const": "ConfigMap"}, "metadata": METADATA,
                             "data": {"type": "object", "additionalProperties": {"type": "string"}}}}


def schema_errors(validators, document: dict[str, Any]) -> list[str]:
    """Every way ``document`` breaks its schema, as 'path: message'."""
    if document["kind"] == "ConfigMap":
        checks = [jsonschema.Draft7Validator(CONFIG_MAP)]
    else:
        validator = validators.get((document["apiVersion"], document["kind"]))
        assert validator is not None, f"no CRD serves {document['apiVersion']} {document['kind']}"
        checks = [validator, jsonschema.Draft7Validator({"properties": {"metadata": METADATA}})]
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
            for check in checks for error in check.iter_errors(document)]


REQUESTS = [
    pytest.param([], ManifestRequest(image=IMAGE), id="pytorchjob-cpu-1"),
    pytest.param(["--run.nproc=4", "--checkpoint.enabled=false"], ManifestRequest(image=IMAGE, nodes="3"),
                 id="pytorchjob-cpu-3x4"),
    pytest.param(["--run.dir=/runs"], ManifestRequest(image=IMAGE, nodes="2", gpus_per_node=8, checkpoint_pvc="c"),
                 id="pytorchjob-2x8"),
    pytest.param(["--checkpoint.dir=s3://b/c"], ManifestRequest(image=IMAGE, nodes="1:4", gpus_per_node=8,
                                                               storage_secret="s3", queue="q", namespace="ns"),
                 id="pytorchjob-elastic"),
    pytest.param([], ManifestRequest(image=IMAGE, kind="trainjob", gpus_per_node=1), id="trainjob-1x1"),
    pytest.param(["--checkpoint.dir=s3://b/c"], ManifestRequest(image=IMAGE, kind="trainjob", nodes="4",
                                                               gpus_per_node=8, storage_secret="s3", queue="q"),
                 id="trainjob-4x8-s3"),
]


@pytest.mark.parametrize("overrides, request_", REQUESTS)
def test_every_manifest_validates_against_its_schema(overrides, request_, validators):
    documents = manifests(config_of(overrides), request_)
    assert [d["kind"] for d in documents] == ["ConfigMap", "TrainJob" if request_.kind == "trainjob" else "PyTorchJob"]
    for document in documents:
        assert schema_errors(validators, document) == []
    # What kubectl reads is the printed text: it parses back to the same objects.
    assert list(yaml.safe_load_all(to_yaml(documents))) == documents


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_manifests_validate(name, validators):
    for document in yaml.safe_load_all((HERE / name).read_text()):
        assert schema_errors(validators, document) == []


def test_the_schema_check_catches_wrong_types_unknown_fields_and_missing_fields(validators):
    _, job = manifests(config_of(["--run.dir=/runs"]), GOLDEN["pytorchjob-2x8.yaml"][1])
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "1"
    assert schema_errors(validators, job) == ["spec.pytorchReplicaSpecs.Worker.replicas: '1' is not of type 'integer'"]
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 1
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["imagee"] = IMAGE
    assert any("'imagee' was unexpected" in error for error in schema_errors(validators, job))

    _, train = manifests(config_of(["--checkpoint.dir=/checkpoints"]), GOLDEN["trainjob-2x8.yaml"][1])
    del train["spec"]["runtimeRef"]
    assert schema_errors(validators, train) == ["spec: 'runtimeRef' is a required property"]


def test_int_or_string_fields_take_either_and_nothing_else(validators):
    _, train = manifests(config_of(["--checkpoint.dir=/checkpoints"]), GOLDEN["trainjob-2x8.yaml"][1])
    for value in (8, "auto", "gpu"):
        train["spec"]["trainer"]["numProcPerNode"] = value
        assert schema_errors(validators, train) == []
    for value in (8.5, [8], None):
        train["spec"]["trainer"]["numProcPerNode"] = value
        assert schema_errors(validators, train), value
    train["spec"]["trainer"]["numProcPerNode"] = 8
    limits = train["spec"]["trainer"]["resourcesPerNode"]["limits"]
    limits["nvidia.com/gpu"] = "8"  # a quantity is an int or a string of its pattern
    assert schema_errors(validators, train) == []
    limits["nvidia.com/gpu"] = "eight"
    errors = schema_errors(validators, train)
    assert len(errors) == 1 and errors[0].startswith("spec.trainer.resourcesPerNode.limits.nvidia.com/gpu: 'eight' "
                                                     "does not match")


def test_the_marker_conversion_keeps_unknown_fields_only_where_asked():
    schema = kubernetes_to_draft7({"type": "object", "properties": {
        "strict": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {"type": "string"}}},
        "port": {"x-kubernetes-int-or-string": True},
    }})
    check = jsonschema.Draft7Validator(schema)
    assert check.is_valid({"strict": {"a": 1}, "open": {"a": "x", "b": [1]}, "port": "http"})
    assert check.is_valid({"port": 80})
    assert not check.is_valid({"strict": {"a": 1, "b": 2}})
    assert not check.is_valid({"open": {"a": 1}})
    assert not check.is_valid({"port": 1.5})


# ---------------------------------------------------------------- golden files


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_manifests_match_the_golden_files(name):
    assert golden_text(name) == (HERE / name).read_text()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_config_map_holds_the_resolved_config(name):
    overrides, request = GOLDEN[name]
    config = config_of(overrides)
    config_map, job = manifests(config, request)
    held = tomllib.loads(config_map["data"][CONFIG_KEY])
    expected = recorded_dict(config)
    expected["run"].update(nnodes=request.nodes, nproc=request.gpus_per_node, rdzv_id=request.name,
                           rdzv_endpoint="", node_rank=-1)
    assert held == expected
    assert config_map["metadata"]["name"] == f"{job['metadata']['name']}-config"


def test_credentials_never_reach_the_config_map():
    config = config_of(["--checkpoint.dir=s3://b/c", "--checkpoint.storage_options={ key = 'AKIA', secret = 'S' }"])
    config_map, _ = manifests(config, ManifestRequest(image=IMAGE, nodes="2", gpus_per_node=8, storage_secret="s3"))
    text = config_map["data"][CONFIG_KEY]
    assert "AKIA" not in text and "'S'" not in text and REDACTED in text


# ---------------------------------------------------------------- what the pods run


def kubelet_start(command: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of the process a pod starts: the kubelet expands ``$(VAR)``
    from the container's variables, then ``env -u NAME`` removes NAME."""
    argv = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)
            for arg in command]
    env = dict(env)
    if argv[0] == "env":
        argv = argv[1:]
        while argv[0] == "-u":
            env.pop(argv[1], None)
            argv = argv[2:]
    return argv, env


def meshyard_run(argv: list[str]) -> tuple[Any, list[str]]:
    """What ``meshyard run`` makes of ``argv`` (without the program name): its arguments, and
    its config overrides (its flags are applied to the loaded config by ``with_run_flags``)."""
    assert argv[:2] == ["meshyard", "run"]
    overrides, rest = group_override_tokens(argv[1:])
    return build_parser().parse_args(rest), overrides


OPERATOR_ENV = {
    # What the training operator (v1.7+) gives the container of the first Worker of a 2-node,
    # 8-GPU PyTorchJob named exp-42, and the kubelet adds.
    "pytorchjob": {"MASTER_ADDR": "exp-42-master-0", "MASTER_PORT": "23456", "PET_MASTER_ADDR": "exp-42-master-0",
                   "PET_MASTER_PORT": "23456", "WORLD_SIZE": "16", "RANK": "1", "PET_NPROC_PER_NODE": "8",
                   "PET_NODE_RANK": "1", "PET_NNODES": "2", "PYTHONUNBUFFERED": "1",
                   "KUBERNETES_SERVICE_HOST": "10.96.0.1"},
    # What Kubeflow Trainer's torch plugin gives the second node of TrainJob exp-44.
    "trainjob": {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",
                 "PET_MASTER_ADDR": "exp-44-node-0-0.exp-44", "PET_MASTER_PORT": "29400",
                 "KUBERNETES_SERVICE_HOST": "10.96.0.1"},
    # An elastic PyTorchJob: Workers only, meeting at the first one.
    "elastic": {"PET_RDZV_ENDPOINT": "exp-43-worker-0:23456", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "2:4",
                "PET_NPROC_PER_NODE": "8", "PET_MAX_RESTARTS": "3", "PYTHONUNBUFFERED": "1",
                "KUBERNETES_SERVICE_HOST": "10.96.0.1"},
}
CASES = {"pytorchjob": "pytorchjob-2x8.yaml", "trainjob": "trainjob-2x8.yaml", "elastic": "pytorchjob-elastic-2to4x8.yaml"}


def pod_command(job: dict[str, Any]) -> list[str]:
    if job["kind"] == "TrainJob":
        return job["spec"]["trainer"]["command"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    return replicas["Worker"]["template"]["spec"]["containers"][0]["command"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_pod_runs_one_meshyard_agent_that_joins_the_job(case, tmp_path):
    """Under the operator's variables the pod's process is no rank of its own (meshyard
    starts the pod's workers), knows its node rank and the rendezvous, and its config
    passes validation at the job's world size."""
    overrides, request = GOLDEN[CASES[case]]
    config_map, job = manifests(config_of(overrides), request)
    argv, env = kubelet_start(pod_command(job), OPERATOR_ENV[case])
    assert detect_environment(env) is None
    args, run_overrides = meshyard_run(argv)
    assert args.config == CONFIG_PATH
    if case == "elastic":
        assert (args.node_rank, args.rdzv_endpoint) == (None, "exp-43-worker-0:23456")
    else:
        assert args.node_rank == 1 and args.rdzv_endpoint == {"pytorchjob": "exp-42-master-0:23456",
                                                              "trainjob": "exp-44-node-0-0.exp-44:29400"}[case]
    mounted = tmp_path / "config.toml"
    mounted.write_text(config_map["data"][CONFIG_KEY])
    config = with_run_flags(load_config(mounted, run_overrides), args)
    assert (config.run.nproc, config.run.rdzv_id) == (8, request.name)
    low, _, high = request.nodes.partition(":")
    validate(config, int(high or low) * 8)


def test_without_removing_the_operators_rank_the_pod_would_be_taken_for_one_rank():
    """Why the PyTorchJob command starts with 'env -u RANK -u WORLD_SIZE'."""
    cluster = detect_environment(OPERATOR_ENV["pytorchjob"])
    assert cluster is not None and (cluster.source, cluster.rank, cluster.world_size) == ("kubeflow", 1, 16)


def test_a_one_node_job_runs_without_rendezvous_options():
    _, job = manifests(config_of([]), ManifestRequest(image=IMAGE, gpus_per_node=8))
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["env", "-u", "RANK", "-u", "WORLD_SIZE", "meshyard", "run", CONFIG_PATH]
    _, train = manifests(config_of([]), ManifestRequest(image=IMAGE, kind="trainjob"))
    assert train["spec"]["trainer"]["command"] == ["meshyard", "run", CONFIG_PATH]


def test_a_cpu_job_asks_for_no_gpus_and_runs_run_nproc_workers():
    _, job = manifests(config_of(["--run.nproc=3", "--train.global_batch=48", "--checkpoint.enabled=false"]),
                       ManifestRequest(image=IMAGE, nodes="2"))
    assert job["spec"]["nprocPerNode"] == "3" and job["spec"]["runPolicy"]["backoffLimit"] == 3
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        assert "resources" not in replica["template"]["spec"]["containers"][0]
    _, default = manifests(config_of([]), ManifestRequest(image=IMAGE))
    assert default["spec"]["nprocPerNode"] == "2"  # as 'meshyard run' on a CPU-only machine


def test_the_volume_goes_where_the_checkpoints_go():
    def mount(overrides: list[str]) -> list[str]:
        _, job = manifests(config_of(overrides), ManifestRequest(image=IMAGE, checkpoint_pvc="ckpt"))
        container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        return [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "checkpoints"]

    assert mount(["--checkpoint.dir=/data/ckpt/"]) == ["/data/ckpt"]
    assert mount(["--run.dir=/runs"]) == ["/runs"]
    assert mount(["--run.run_dir=/runs/exp", "--run.dir=relative"]) == ["/runs/exp"]
    assert mount(["--checkpoint.dir=file:///ckpt"]) == ["/ckpt"]


def test_default_names_are_valid_kubernetes_names():
    assert default_name("My Run_1") == "my-run-1"
    assert default_name("42-answers") == "answers"
    assert default_name("___") == "meshyard"
    assert len(default_name("x" * 80)) == 40
    _, job = manifests(config_of(["--run.name=Big_Run"]), ManifestRequest(image=IMAGE))
    assert job["metadata"]["name"] == "big-run"


# ---------------------------------------------------------------- bad requests


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["k8s", "manifest", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, fragments", [
    pytest.param(["--nodes", "2"], ["--image ''", "needs the container image"], id="no-image"),
    pytest.param(["--image", IMAGE, "--gpus-per-node", "8", "--run.device=cpu"],
                 ["--gpus-per-node 8 asks for GPUs", "run.device = 'cpu'"], id="gpus-on-cpu"),
    pytest.param(["--image", IMAGE, "--run.device=cuda"], ["run.device = 'cuda'", "--gpus-per-node G"],
                 id="cuda-without-gpus"),
    pytest.param(["--image", IMAGE, "--gpus-per-node", "8", "--parallel.tp=3"], ["parallel.tp"],
                 id="layout-does-not-fit"),
    pytest.param(["--image", IMAGE, "--nodes", "3", "--gpus-per-node", "8", "--train.global_batch=32",
                  "--checkpoint.enabled=false"], ["not divisible by the data-parallel size 24"],
                 id="batch-does-not-fit"),
    pytest.param(["--image", IMAGE, "--nodes", "2:3", "--gpus-per-node", "8", "--train.global_batch=72",
                  "--checkpoint.enabled=false"],
                 ["--nodes 2:3 lets the job run on fewer nodes", "with 2 node(s) (16 ranks)"], id="elastic-range-unfit"),
    pytest.param(["--image", IMAGE, "--nodes", "0"], ["--nodes '0' is neither a node count of at least 1"],
                 id="zero-nodes"),
    pytest.param(["--image", IMAGE, "--nodes", "two"], ["--nodes 'two'"], id="nodes-not-a-number"),
    pytest.param(["--image", IMAGE, "--kind", "pytorchjobs"], ["--kind 'pytorchjobs' is not known",
                                                               "did you mean 'pytorchjob'"], id="bad-kind"),
    pytest.param(["--image", IMAGE, "--kind", "trainjob", "--nodes", "2:4", "--checkpoint.enabled=false"],
                 ["elastic range, which a TrainJob cannot run", "--kind pytorchjob"], id="elastic-trainjob"),
    pytest.param(["--image", IMAGE, "--nodes", "2"], ["a job of 2 pods needs checkpoint storage every pod sees",
                                                      "--checkpoint-pvc"], id="unshared-checkpoints"),
    pytest.param(["--image", IMAGE, "--checkpoint-pvc", "ckpt"], ["run.dir = 'runs' is not an absolute path"],
                 id="pvc-relative-dir"),
    pytest.param(["--image", IMAGE, "--checkpoint-pvc", "ckpt", "--checkpoint.dir=s3://b/c"],
                 ["is object storage: drop --checkpoint-pvc"], id="pvc-with-s3"),
    pytest.param(["--image", IMAGE, "--storage-secret", "s3"], ["is not object storage"], id="secret-without-s3"),
    pytest.param(["--image", IMAGE, "--name", "Exp_1"], ["--name 'Exp_1' is not a valid Kubernetes name"],
                 id="bad-name"),
    pytest.param(["--image", IMAGE, "--gpus-per-node", "8", "--run.nproc=4"],
                 ["run.nproc = 4 but --gpus-per-node 8"], id="nproc-against-gpus"),
    pytest.param(["--image", IMAGE, "--gpus-per-node", "-1"], ["--gpus-per-node -1 must not be negative"],
                 id="negative-gpus"),
])
def test_bad_requests_exit_2_with_one_clear_message(argv, fragments, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == BAD_INPUT, err
    assert out == ""  # nothing half-written for kubectl
    for fragment in fragments:
        assert fragment in err
    assert "Traceback" not in err


def test_every_problem_is_reported_at_once(capsys):
    code, _, err = run_cli(["--kind", "mpijob", "--run.device=cpu", "--gpus-per-node", "2", "--train.steps=0"],
                           capsys)
    assert code == BAD_INPUT
    for fragment in ("--image ''", "--kind 'mpijob'", "asks for GPUs", "train.steps = 0"):
        assert fragment in err


def test_the_library_raises_config_error():
    with pytest.raises(ConfigError, match="needs the container image"):
        manifests(config_of([]), ManifestRequest(image=""))


def test_the_command_prints_what_kubectl_applies(capsys):
    code, out, err = run_cli([*BASE, "--image", IMAGE, "--nodes", "2", "--gpus-per-node", "8", "--name", "exp-42",
                              "--namespace", "ml", "--checkpoint-pvc", "ckpt", "--queue", "team-a", "--run.dir=/runs"],
                             capsys)
    assert code == 0, err
    overrides, request = GOLDEN["pytorchjob-2x8.yaml"]
    assert out == to_yaml(manifests(config_of(overrides), request))
    assert f"{CONFIG_KEY}: |\n    [model]\n" in out  # the config reads as the file it is


def test_without_pyyaml_the_command_names_the_k8s_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "yaml", None)
    code, out, err = run_cli(["--image", IMAGE], capsys)
    assert code == BAD_INPUT and out == ""
    assert "pip install 'meshyard[k8s]'" in err and "Traceback" not in err


def write_goldens() -> None:
    """Rewrite the golden files from the current code (read the diff before committing it)."""
    for name in sorted(GOLDEN):
        (HERE / name).write_text(golden_text(name))
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    write_goldens()


# ---------------------------------------------------------------- placement

def test_a_placement_keeps_the_pods_to_its_nodes(tmp_path, capsys, validators):
    """`meshyard place --json` -> `k8s manifest --placement`: every pod gets the node affinity."""
    inventory = tmp_path / "nodes.toml"
    inventory.write_text('levels = ["leaf"]\n' + "".join(
        f'[[nodes]]\nname = "{name}"\nfree_gpus = {free}\ngpu_memory_gb = 80\ndomains = ["{leaf}"]\n'
        for name, free, leaf in (("a1", 8, "l1"), ("a2", 8, "l1"), ("b1", 8, "l2"), ("b2", 4, "l2"))))
    assert main(["place", "--nodes", str(inventory), "--gpus", "16", "--json", "--model.name=gpt-tiny"]) == 0
    placement = tmp_path / "placement.json"
    placement.write_text(capsys.readouterr().out)
    code, out, err = run_cli(["--image", IMAGE, "--nodes", "2", "--gpus-per-node", "8",
                              "--checkpoint.dir=s3://b/c", "--placement", str(placement)], capsys)
    assert code == 0, err
    job = list(yaml.safe_load_all(out))[1]
    assert schema_errors(validators, job) == []
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        terms = replica["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["a1", "a2"]  # one leaf, filled


@pytest.mark.parametrize("argv, fragment", [
    (["--nodes", "3"], "names 2 node(s) but --nodes 3"),
    (["--nodes", "2", "--kind", "trainjob"], "take no node affinity"),
])
def test_a_placement_the_job_cannot_follow_is_refused(tmp_path, capsys, argv, fragment):
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"nodes": [{"name": "a1", "gpus": 8}, {"name": "a2", "gpus": 8}]}))
    code, out, err = run_cli(["--image", IMAGE, "--gpus-per-node", "8", "--checkpoint.dir=s3://b/c",
                              "--placement", str(placement), *argv], capsys)
    assert code == 2 and out == "" and fragment in err


def test_a_placement_file_that_is_not_places_json_is_refused(tmp_path, capsys):
    bad = tmp_path / "placement.json"
    bad.write_text("[1, 2]")
    code, _, err = run_cli(["--image", IMAGE, "--placement", str(bad)], capsys)
    assert code == 2 and "is not the JSON of 'meshyard place --json'" in err

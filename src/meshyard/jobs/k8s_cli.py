"""``meshyard k8s manifest`` and ``meshyard k8s serve-manifest``: parsing and YAML printing;
the manifests themselves come from ``meshyard.jobs.kubernetes`` (training) and
``meshyard.jobs.serve_manifest`` (serving)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from meshyard.config.load import ConfigError, collect_config
from meshyard.extras import require
from meshyard.jobs.kubernetes import KINDS, ManifestRequest, manifests
from meshyard.jobs.serve_manifest import IN_FLIGHT_METRIC, ServeRequest, serve_manifests
from meshyard.run_dir import RunDir

DESCRIPTION = """\
Print the Kubernetes manifests of a meshyard job, for 'kubectl apply -f -': a ConfigMap
holding the resolved config, mounted into every pod, and a Kubeflow PyTorchJob (training
operator) or TrainJob (Kubeflow Trainer) whose pods each run one meshyard agent with one
worker per GPU. The job's name names the run directory, so a restarted pod resumes from
the newest checkpoint on the checkpoint volume (--checkpoint-pvc) or in object storage."""

EPILOG = """\
examples:
  meshyard k8s manifest my.toml --image ghcr.io/me/train:1 --nodes 2 --gpus-per-node 8 \\
      --checkpoint-pvc ckpt --run.dir=/runs | kubectl apply -f -
  meshyard k8s manifest my.toml --image ghcr.io/me/train:1 --nodes 2:4 --gpus-per-node 8 \\
      --checkpoint.dir=s3://bucket/ckpt --storage-secret s3-creds --queue team-a
  meshyard k8s manifest my.toml --image ghcr.io/me/train:1 --kind trainjob --nodes 2 --gpus-per-node 8 \\
      --checkpoint-pvc ckpt --checkpoint.dir=/ckpt

Config fields can be set with --section.field=value, as for 'meshyard run'."""

SERVE_DESCRIPTION = f"""\
Print the Kubernetes manifests that serve a trained run, for 'kubectl apply -f -': a
Deployment whose pods run 'meshyard serve' on the run (ready once its model is loaded), a
ClusterIP Service (port "http"), and a HorizontalPodAutoscaler that keeps the in-flight
requests per pod ({IN_FLIGHT_METRIC}, through a custom-metrics adapter such as
prometheus-adapter) at --target-in-flight, with CPU utilization as the fallback. The pods
find the run on --model-pvc (mounted read-only) or, without it, in the image at RUN's path
as given. Memory is sized from the model's bytes in RUN's newest checkpoint unless
--memory is given."""

SERVE_EPILOG = """\
examples:
  meshyard k8s serve-manifest runs/exp-1-42 --image ghcr.io/me/serve:1 --model-pvc runs \\
      --min-replicas 2 --max-replicas 10 | kubectl apply -f -
  meshyard k8s serve-manifest /srv/runs/exp-1 --image ghcr.io/me/serve-exp-1:1 --gpus 1 \\
      --serve.max_batch_size=32 --serve.cache=redis://redis:6379/0

The server's settings are --serve.FIELD=VALUE overrides, passed to every pod's 'meshyard serve'."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``meshyard k8s`` with its ``manifest`` and ``serve-manifest`` subcommands."""
    p = subparsers.add_parser("k8s", help="write Kubernetes manifests: a Kubeflow job for a config, or the serving "
                              "of a trained run", description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(handler=main)
    sub = p.add_subparsers(dest="k8s_command", required=True, metavar="{manifest,serve-manifest}")
    manifest = sub.add_parser("manifest", help="print the ConfigMap and the job as YAML", description=DESCRIPTION,
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    manifest.add_argument("config", nargs="?", help="TOML config file (optional)")
    manifest.add_argument("--image", default="", help="container image with meshyard and your code installed (required)")
    manifest.add_argument("--nodes", default="1", metavar="N|MIN:MAX",
                          help="pods (nodes) of the job, or a range for an elastic PyTorchJob (default 1)")
    manifest.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                          help="GPUs per pod, one worker each (default 0: a CPU job with run.nproc workers per pod)")
    manifest.add_argument("--kind", default="pytorchjob", metavar="|".join(KINDS),
                          help="pytorchjob (Kubeflow training operator, default) or trainjob (Kubeflow Trainer)")
    manifest.add_argument("--name", default="", help="the job's name (default: run.name); it names the run directory")
    manifest.add_argument("--namespace", default="", help="namespace of the objects (default: kubectl's)")
    manifest.add_argument("--checkpoint-pvc", default="", metavar="NAME",
                          help="PersistentVolumeClaim mounted at checkpoint.dir (or, when that is empty, run.dir); "
                          "ReadWriteMany for several pods")
    manifest.add_argument("--storage-secret", default="", metavar="NAME",
                          help="Secret whose entries become the pods' environment: credentials for an s3:// "
                          "checkpoint.dir (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...)")
    manifest.add_argument("--queue", default="", metavar="NAME", help="Kueue LocalQueue to submit the job to")
    manifest.add_argument("--placement", default="", metavar="FILE",
                          help="the JSON 'meshyard place --json' wrote: keep the pods to the nodes it chose")
    _add_serve_parser(sub)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-manifest", help="print the Deployment, Service and autoscaler that serve a run",
                       description=SERVE_DESCRIPTION, epilog=SERVE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help=f"the run directory (its {RunDir.CONFIG} and checkpoints)")
    p.add_argument("--image", default="", help="container image with meshyard installed (required)")
    p.add_argument("--name", default="", help="name of the objects (default: run.name)")
    p.add_argument("--namespace", default="", help="namespace of the objects (default: kubectl's)")
    p.add_argument("--replicas", type=int, default=None, metavar="R",
                   help="pods on the first apply (default: left to the autoscaler, from --min-replicas)")
    p.add_argument("--min-replicas", type=int, default=1, metavar="A", help="fewest pods (default 1)")
    p.add_argument("--max-replicas", type=int, default=4, metavar="B", help="most pods (default 4)")
    p.add_argument("--target-in-flight", type=float, default=0.0, metavar="T",
                   help="average in-flight requests per pod to scale at (default: serve.max_batch_size)")
    p.add_argument("--cpu-target", type=int, default=70, metavar="PERCENT",
                   help="average CPU utilization to scale at, the fallback metric (default 70)")
    p.add_argument("--model-pvc", default="", metavar="PVC", help="PersistentVolumeClaim holding the run, mounted "
                   "read-only (default: the image holds the run at RUN's path)")
    p.add_argument("--model-path", default="", metavar="PATH",
                   help="the run directory inside --model-pvc (default: RUN's own name)")
    p.add_argument("--port", type=int, default=0, metavar="P", help="the server's port (default: serve.port, 8000)")
    p.add_argument("--gpus", type=int, default=0, metavar="G", help="GPUs per pod (default 0)")
    p.add_argument("--cpu", default="", metavar="C", help="CPU request per pod (default: serve.threads, else 2)")
    p.add_argument("--memory", default="", metavar="M",
                   help="memory per pod, e.g. 8Gi (default: sized from the model's bytes in RUN's checkpoint)")


def _request(args: argparse.Namespace) -> ManifestRequest:
    return ManifestRequest(image=args.image, nodes=args.nodes, gpus_per_node=args.gpus_per_node, kind=args.kind,
                           namespace=args.namespace, checkpoint_pvc=args.checkpoint_pvc,
                           storage_secret=args.storage_secret, queue=args.queue, name=args.name,
                           placement=placed_nodes(args.placement) if args.placement else ())


def placed_nodes(path: str) -> tuple[str, ...]:
    """The node names of a ``meshyard place --json`` file, in node-rank order."""
    try:
        nodes = json.loads(Path(path).read_text())["nodes"]
        return tuple(str(node["name"]) for node in nodes)
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror})"
    except (ValueError, KeyError, TypeError):
        problem = "is not the JSON of 'meshyard place --json' ({\"nodes\": [{\"name\", \"gpus\"}, ...]})"
    raise ConfigError([f"--placement {path} {problem}"], "arguments")


def _serve_request(args: argparse.Namespace, overrides: list[str]) -> ServeRequest:
    return ServeRequest(run_dir=args.run, image=args.image, name=args.name, namespace=args.namespace,
                        replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                        target_in_flight=args.target_in_flight, cpu_target=args.cpu_target,
                        model_pvc=args.model_pvc, model_path=args.model_path, port=args.port, gpus=args.gpus,
                        cpu=args.cpu, memory=args.memory, serve_overrides=tuple(overrides))


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Print the manifests; bad input raises ``ConfigError`` (or ``MissingExtra`` without PyYAML)."""
    require("yaml", f"meshyard k8s {args.k8s_command}")
    if args.k8s_command == "serve-manifest":
        documents = serve_manifests(_serve_request(args, overrides))
    else:
        config, problems = collect_config(args.config, overrides)
        documents = manifests(config, _request(args), problems)
    print(to_yaml(documents), end="")
    return 0


def to_yaml(documents: list[dict[str, Any]]) -> str:
    """``documents`` as one YAML stream, keys in the order built, multi-line text (the
    config) as a literal block that reads like the file."""
    yaml = require("yaml", "meshyard k8s manifest")

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # the Master's and the Workers' pod templates are written out, not '*id001'

    def text(dumper: Any, value: str) -> Any:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump_all(documents, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120)

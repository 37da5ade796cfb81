"""``meshyard serve``: parse the command line, describe the models, run the HTTP server.

The flags are shorthands for ``--serve.*`` settings (``meshyard.config.sections.ServeConfig``);
the models' own settings come from their run directories. Every model is described (config
and version, no weights) before the server starts, so a wrong path or canary is refused
at once, in one paragraph, with exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from meshyard.config.checks import CACHE_SCHEMES, section_problems
from meshyard.config.load import ConfigError, group_override_tokens, load_section
from meshyard.config.sections import ServeConfig
from meshyard.errors import BadInput, call_command
from meshyard.extras import require
from meshyard.run_dir import RunDir
from meshyard.runtime.collector import freeze_long_lived

DESCRIPTION = f"""\
Serve trained models over HTTP with dynamic or continuous batching. Each PATH is a run directory (its
newest valid checkpoint), one checkpoint (.../{RunDir.CHECKPOINTS}/step-N) or a file written by
'meshyard export'; a bare PATH is served under its run's name (run.name), NAME=PATH under
NAME. Models load on their first request (--pin loads them at start-up) and are evicted
by --serve.memory_budget_bytes.

""" + """\
API: POST /v1/models/NAME/generate {"prompt": "text"} or {"tokens": [ids]} (max_new_tokens,
temperature, top_k, seed, timeout_ms); POST /v1/models/NAME/logits {"sequences": [[ids]]}
or {"prompts": ["text"]} (top_k); GET /v1/models, /healthz, /readyz, /metrics. The header
X-Model-Version pins a version. OpenAI-compatible: POST /v1/completions and POST
/v1/chat/completions (for models whose tokenizer_config.json has a chat_template, or all
with --serve.chat_template=FILE.jinja)."""

EPILOG = f"""\
examples:
  meshyard serve runs/tiny
  meshyard serve chat=runs/tiny code=runs/coder/{RunDir.CHECKPOINTS}/step-00000400 --pin chat
  meshyard serve runs/tiny --canary tiny=runs/tiny-v2:0.1 --cache redis://127.0.0.1:6379/0
  meshyard serve model.onnx --runtime onnxruntime --host 0.0.0.0 --port 8080

Every setting of the [serve] section can be given as --serve.FIELD=VALUE, e.g.
--serve.max_batch_size=32 --serve.max_wait_ms=2 --serve.memory_budget_bytes=4000000000;
'meshyard config show' documents them."""


class ServeArgumentError(BadInput, ValueError):
    """A command line that cannot be served; the message says what to give instead."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``meshyard serve``. All its bad input (a path, canary or pin, the [serve]
    settings, a missing extra) is told as ``meshyard serve: ...``."""
    p = subparsers.add_parser("serve", help="serve trained models over HTTP (dynamic batching, canaries, caching)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", metavar="PATH|NAME=PATH",
                   help="run directory, checkpoint or export to serve; NAME=PATH serves it under NAME")
    p.add_argument("--host", help="address to bind (default 127.0.0.1, loopback; 0.0.0.0 opens it)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--canary", action="append", default=[], metavar="NAME=PATH:WEIGHT",
                   help="serve PATH as a new version of NAME taking WEIGHT (0-1) of its traffic; repeatable")
    p.add_argument("--cache", metavar="memory|off|redis://HOST:PORT/DB",
                   help="prediction cache for deterministic requests (default memory)")
    p.add_argument("--pin", action="append", default=[], metavar="NAME",
                   help="load NAME at start-up and never evict it (/readyz waits for it); repeatable")
    p.add_argument("--runtime", metavar="eager|torchscript|onnxruntime", help="what runs the models (default eager)")
    p.add_argument("--scheduler", metavar="auto|dynamic|continuous",
                   help="how generate requests are batched (default auto: continuous for models with a KV cache "
                        "on a GPU, dynamic on the CPU)")
    p.add_argument("--ready-file", metavar="FILE",
                   help='write {"url", "pid"} as JSON to FILE once the server listens')
    p.set_defaults(handler=main, own_errors=(BadInput,), error_prefix="meshyard serve")


def settings(args: argparse.Namespace, overrides: list[str]) -> ServeConfig:
    """The [serve] settings: ``--serve.*`` overrides, then the flags (which win)."""
    foreign = [o for o in overrides if not o.lstrip("-").startswith("serve.")]
    if foreign:
        raise ServeArgumentError(
            f"'meshyard serve' takes only --serve.FIELD overrides, not {' '.join(foreign)}: a served model's "
            "own settings come from its run directory; 'meshyard config show' lists the [serve] fields")
    flags: dict[str, Any] = {"host": args.host, "port": args.port, "cache": args.cache, "runtime": args.runtime,
                             "scheduler": args.scheduler, "pinned": args.pin or None}
    # JSON strings and arrays are TOML values too, so every flag keeps its type and text.
    given = [f"--serve.{key}={json.dumps(value)}" for key, value in flags.items() if value is not None]
    # Only the [serve] section is read and checked: a server needs no training config.
    serve = load_section("serve", None, [*overrides, *given])
    problems = section_problems("serve", serve)
    if problems:
        raise ConfigError(problems)
    return serve


def split_model(text: str) -> tuple[str | None, str]:
    """``NAME=PATH`` -> (NAME, PATH); a bare PATH (even one holding '=') -> (None, PATH)."""
    name, sep, path = text.partition("=")
    if not sep or not name or "/" in name or os.sep in name or Path(text).exists():
        return None, text
    if not path:
        raise ServeArgumentError(f"'{text}' names the model '{name}' but no path; give NAME=PATH, e.g. "
                                 f"{name}=runs/{name}")
    return name, path


def split_canary(text: str) -> tuple[str, str, float]:
    """``NAME=PATH:WEIGHT`` -> (NAME, PATH, WEIGHT)."""
    name, _, rest = text.partition("=")
    path, _, weight = rest.rpartition(":")
    try:
        share = float(weight)
    except ValueError:
        share = float("nan")
    if not name or not path or not 0.0 < share < 1.0:
        raise ServeArgumentError(f"--canary {text} is not NAME=PATH:WEIGHT with WEIGHT between 0 and 1 exclusive; "
                                 "e.g. --canary tiny=runs/tiny-v2:0.1 sends a tenth of tiny's traffic to runs/tiny-v2")
    return name, path, share


def routes(args: argparse.Namespace, cfg: ServeConfig) -> Any:
    """The ``Router`` of the models and canaries on the command line (each described, no
    weights loaded); raises ``ServeArgumentError`` naming a wrong path, canary or pin."""
    # Loading stands on torch and the checkpoint readers: imported when serving, not for
    # every ``meshyard`` command line (this module is registered by ``meshyard.cli``).
    from meshyard.inference.loading import describe
    from meshyard.inference.source import ModelSourceError
    from meshyard.serve.routing import RouteError, Router

    try:
        main = [describe(path, name) for name, path in map(split_model, args.models)]
        canaries = [(describe(path, name), weight) for name, path, weight in map(split_canary, args.canary)]
        router = Router.from_specs(main, canaries)
    except (ModelSourceError, RouteError) as exc:
        raise ServeArgumentError(str(exc)) from None
    unknown = [name for name in cfg.pinned if name not in router.names()]
    if unknown:
        raise ServeArgumentError(f"--pin {', '.join(unknown)}: no model is served under that name (served: "
                                 f"{', '.join(router.names())}); pin one of the served names")
    return router


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), for uvicorn to listen on; port 0 takes a free one."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise ServeArgumentError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another "
                                 "--port (0 takes any free one) or --host") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def write_ready_file(path: str, url: str) -> None:
    """``{"url", "pid"}`` written whole (renamed into place), so a reader never sees half of it."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    partial.replace(target)


class StopRequest:
    """The signal handler outside uvicorn's own: it notes a SIGTERM or SIGINT that arrives
    before uvicorn listens for them (the server then stops as soon as it has started), and
    takes the one uvicorn raises again after its shutdown, so a stopped server exits 0."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.requested = True


async def serve_until_stopped(app: Any, sock: socket.socket, ready_file: str | None, stop: StopRequest,
                              cfg: ServeConfig) -> None:
    """Runs uvicorn on ``sock`` until SIGTERM or SIGINT; says where it listens once it does.
    Its connections keep ``cfg``'s read deadline and connection cap (``meshyard.serve.connections``)."""
    import uvicorn

    from meshyard.serve.connections import guarded_protocol, make_room_for
    from meshyard.serve.routes import connection_refusal

    make_room_for(cfg.max_connections)
    protocol = guarded_protocol(cfg.read_timeout_s, cfg.max_connections, connection_refusal(cfg.max_connections))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http=protocol,
                                          ws="none", timeout_keep_alive=cfg.keep_alive_timeout_s))
    running = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not running.done():
        server.should_exit = server.should_exit or stop.requested
        await asyncio.sleep(0.02)
    server.should_exit = server.should_exit or stop.requested
    if server.started and not server.should_exit:
        url = url_of(sock)
        print(f"listening on {url}", flush=True)
        if ready_file:
            write_ready_file(ready_file, url)
    await running


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """``meshyard serve``: 0 after SIGTERM or SIGINT; a command line that cannot be served
    raises ``BadInput`` (exit code 2) before anything listens."""
    cfg = settings(args, overrides)
    for module in ("starlette", "uvicorn", "httptools", *(["redis"] if cfg.cache.startswith(CACHE_SCHEMES) else [])):
        require(module, "meshyard serve" if module != "redis" else f"serve.cache = '{cfg.cache}'")
    router = routes(args, cfg)
    from meshyard.inference.chat_template import ChatTemplateError
    from meshyard.serve.chat import configured_template

    try:
        chat_template = configured_template(cfg)  # a missing or broken file is refused before listening
    except ChatTemplateError as exc:
        raise ServeArgumentError(f"serve.chat_template: {exc}") from None
    sock = listen(cfg.host, cfg.port)
    from meshyard.serve.app import Server
    from meshyard.serve.routes import build_app

    # serve.threads is set on the inference thread, where every model call runs (Server).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for source, weight in router.listing():
        share = "" if weight == 1.0 else f" ({weight:.0%} of '{source.name}' traffic)"
        print(f"serving {source.name} version {source.version} from {source.path}{share}", flush=True)
    stop = StopRequest()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, stop)
    server = Server(cfg, router, chat_template=chat_template)
    app = build_app(server)
    # What the imports and the app made lives as long as the server: frozen out of the
    # collector's reach, a full collection takes under 1 ms instead of ~170 ms (torch's
    # objects alone are hundreds of thousands), a pause every few thousand requests.
    freeze_long_lived()
    asyncio.run(serve_until_stopped(app, sock, args.ready_file, stop, cfg))
    return 0


def _standalone(argv: list[str]) -> int:
    """``python -m meshyard.serve.cli ...``: the same command outside the ``meshyard`` entry point."""
    parser = argparse.ArgumentParser(prog="meshyard")
    register(parser.add_subparsers(dest="command", required=True))
    overrides, rest = group_override_tokens(argv)
    return call_command(parser.parse_args(["serve", *rest]), overrides)


if __name__ == "__main__":
    sys.exit(_standalone(sys.argv[1:]))

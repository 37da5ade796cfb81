"""``meshyard serve`` end to end: real server processes answering HTTP.

Two servers run for the module. ``main`` serves a trained text model (pinned), a user's
own model on token ids and a copy of it that fails on one token; ``stuck`` batches up to 4
requests, waits a minute for a batch to fill and queues 2, so that a full queue (503) and
a passed deadline (504) follow from its settings rather than from timing.
"""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import httpx
import pytest
import torch

from meshyard.config.sections import ServeConfig
from meshyard.inference.engine import EagerEngine
from meshyard.inference.loading import describe, load_engine
from meshyard.inference.sampling import Sampling
from meshyard.inference.tokenizer import ByteTokenizer
from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.mlp import MLP
from meshyard.serve.app import Server
from meshyard.serve.cli import _standalone
from meshyard.serve.routing import Router
from tests.serve.servers import ServerProcess, concurrently, running_servers
from tests.trained_runs import CUSTOM_MODEL

GENERATE = "/v1/models/tiny/generate"
LOGITS = "/v1/models/tiny/logits"
FAILING_TOKEN = 13


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def fragile_run(tmp_path_factory: pytest.TempPathFactory, custom_model_run: Path) -> Path:
    """The custom model's run, its model file swapped for one whose forward (in eval mode,
    as served) raises on one token: a model that fails inside the server."""
    folder = tmp_path_factory.mktemp("fragile")
    run = Path(shutil.copytree(custom_model_run, folder / "run"))
    signature = "    def forward(self, idx: torch.Tensor) -> torch.Tensor:\n"
    assert signature in CUSTOM_MODEL
    failing = (f"{signature}        if not self.training and bool((idx == {FAILING_TOKEN}).any()):\n"
               f"            raise RuntimeError('token {FAILING_TOKEN} breaks this model')\n")
    (folder / "fragile_lm.py").write_text(CUSTOM_MODEL.replace(signature, failing))
    config = run / "config.toml"
    text = config.read_text()
    old_name = next(line for line in text.splitlines() if line.startswith("name = ") and ".py:build" in line)
    config.write_text(text.replace(old_name, f'name = "{folder / "fragile_lm.py"}:build"'))
    return run


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, trained_run) -> Path:
    """The trained run as a Hugging Face folder (``ckpt export --format hf``): GPT2LMHeadModel."""
    from meshyard.checkpoint.hf_export import export_hugging_face
    from meshyard.checkpoint.locate import locate

    return export_hugging_face(locate(str(trained_run), {}), tmp_path_factory.mktemp("hf") / "gpt2",
                               report=lambda message: None)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, trained_run, custom_model_run, fragile_run, hf_folder) -> list[ServerProcess]:
    main = [str(trained_run), f"custom={custom_model_run}", f"fragile={fragile_run}", f"gpt2={hf_folder}",
            "--pin", "tiny",
            "--serve.max_batch_size=8", "--serve.max_queue=16", "--serve.max_wait_ms=50",
            "--serve.max_body_bytes=4096", "--serve.max_new_tokens=48", "--serve.threads=1",
            "--serve.device=cpu"]  # dynamic batches (scheduler auto) and tokens compared with CPU engines
    stuck = [f"custom={custom_model_run}", "--pin", "custom", "--cache", "off", "--serve.max_batch_size=4",
             "--serve.max_queue=2", "--serve.max_wait_ms=60000", "--serve.threads=1"]
    with running_servers(tmp_path_factory.mktemp("servers"), [main, stuck]) as started:
        yield started


@pytest.fixture(scope="module")
def main(servers: list[ServerProcess]) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def stuck(servers: list[ServerProcess]) -> ServerProcess:
    return servers[1]


@pytest.fixture(scope="module")
def engines(trained_run, custom_model_run) -> dict:
    """The served models loaded in this process: what the server must answer."""
    return {"tiny": load_engine(describe(str(trained_run))), "custom": load_engine(describe(str(custom_model_run)))}


def post(server: ServerProcess, path: str, body: dict, status: int = 200, **kwargs) -> httpx.Response:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60.0, **kwargs)
    assert response.status_code == status, server.explain(response)
    return response


# -- start-up and listing ----------------------------------------------------------------------

def test_the_server_says_what_it_serves_and_where(main, trained_run):
    version = describe(str(trained_run)).version
    assert f"serving tiny version {version} from {trained_run}\n" in main.log()
    assert f"listening on {main.url}\n" in main.log()


def test_health_readiness_and_the_model_listing(main, engines, trained_run):
    with main.client() as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").json() == {"ready": True}  # the pinned model is loaded
        listed = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
    assert set(listed) == {"tiny", "custom", "fragile", "gpt2"}
    assert listed["gpt2"]["version"].startswith("hf.") and listed["gpt2"]["bytes"] > 0
    tiny = listed["tiny"]
    assert tiny == {"name": "tiny", "version": describe(str(trained_run)).version, "loaded": True,
                    "bytes": engines["tiny"].bytes, "pinned": True, "weight": 1.0}
    assert listed["fragile"]["loaded"] is False and listed["fragile"]["pinned"] is False
    assert listed["fragile"]["bytes"] > 0  # estimated from the checkpoint before loading


# -- generate and logits -----------------------------------------------------------------------

def test_greedy_generation_is_the_models_own_and_cached_the_second_time(main, engines):
    body = {"prompt": "The quick brown", "max_new_tokens": 12}
    first, again = post(main, GENERATE, body), post(main, GENERATE, body)
    expected = engines["tiny"].generate([list(b"The quick brown")], [Sampling(max_new_tokens=12)])[0]
    out = first.json()
    assert out["tokens"] == expected and out["text"] == ByteTokenizer().decode(expected)
    assert out["model"] == "tiny" and out["version"] == first.headers["X-Model-Version"]
    assert out["cached"] is False and again.json() == {**out, "cached": True}
    assert again.headers["X-Model-Version"] == out["version"]


def test_seeded_sampling_repeats_and_unseeded_sampling_is_never_cached(main, engines):
    seeded = {"tokens": [10, 20, 30], "max_new_tokens": 10, "temperature": 1.0, "top_k": 40, "seed": 7}
    first, again = post(main, GENERATE, seeded).json(), post(main, GENERATE, seeded).json()
    alone = engines["tiny"].generate([[10, 20, 30]], [Sampling(10, 1.0, 40, 7)])[0]
    assert first["tokens"] == again["tokens"] == alone
    assert (first["cached"], again["cached"]) == (False, True)
    unseeded = {"tokens": [10, 20, 30], "max_new_tokens": 10, "temperature": 1.0}
    answers = [post(main, GENERATE, unseeded).json() for _ in range(2)]
    assert [a["cached"] for a in answers] == [False, False] and all(len(a["tokens"]) == 10 for a in answers)


def test_logits_are_the_models_next_token_log_probabilities(main, engines):
    sequences = [[72, 101], [108]]
    expected = torch.log_softmax(engines["tiny"].next_token_logits(sequences), dim=-1)
    full = torch.tensor(post(main, LOGITS, {"sequences": sequences}).json()["logprobs"])
    assert full.shape == (2, 256) and torch.allclose(full, expected, atol=1e-5)
    top = post(main, LOGITS, {"prompts": ["He", "l"], "top_k": 3}).json()["top"]
    for row, want in zip(top, expected):
        assert [i for i, _ in row] == want.topk(3).indices.tolist()
        assert [v for _, v in row] == pytest.approx(want.topk(3).values.tolist(), abs=1e-5)


def test_a_hugging_face_folder_serves_the_logits_of_the_run_it_was_exported_from(main, engines):
    sequences = [[72, 101, 108], [108]]
    got = torch.tensor(post(main, "/v1/models/gpt2/logits", {"sequences": sequences}).json()["logprobs"])
    expected = torch.log_softmax(engines["tiny"].next_token_logits(sequences), dim=-1)
    assert got.shape == (2, 256) and torch.allclose(got, expected, atol=1e-5)


def test_a_users_own_model_serves_logits_on_token_ids(main, engines):
    sequences = [[1, 2, 3], [96]]
    got = torch.tensor(post(main, "/v1/models/custom/logits", {"sequences": sequences}).json()["logprobs"])
    expected = torch.log_softmax(engines["custom"].next_token_logits(sequences), dim=-1)
    assert got.shape == (2, 97) and torch.allclose(got, expected, atol=1e-5)
    refused = post(main, "/v1/models/custom/logits", {"prompts": ["hi"]}, status=422).json()["error"]
    assert 'send "sequences" instead' in refused


def test_concurrent_requests_share_batches(main, engines):
    labels = {"model": "tiny", "endpoint": "generate"}
    batches_before = main.metric("meshyard_serve_batch_size_count", **labels)
    rows_before = main.metric("meshyard_serve_batch_size_sum", **labels)
    prompts = [[100 + i, 200 - i] for i in range(16)]
    calls = [(GENERATE, {"tokens": prompt, "max_new_tokens": 4}, {}) for prompt in prompts]
    answers = concurrently(main.url, calls)
    assert all(a.status_code == 200 for a in answers), main.explain(answers[0])
    assert main.metric("meshyard_serve_batch_size_sum", **labels) - rows_before == 16
    batches = main.metric("meshyard_serve_batch_size_count", **labels) - batches_before
    assert 2 <= batches < 16  # max_batch_size 8 splits them; some batch held several requests
    alone = [engines["tiny"].generate([p], [Sampling(max_new_tokens=4)])[0] for p in prompts]
    assert [a.json()["tokens"] for a in answers] == alone


def test_the_sequences_of_one_logits_request_run_as_one_batch(main):
    labels = {"model": "tiny", "endpoint": "logits"}
    before = main.metric("meshyard_serve_batch_size_count", **labels), \
        main.metric("meshyard_serve_batch_size_sum", **labels)
    post(main, LOGITS, {"sequences": [[i, i + 1] for i in range(30, 38)], "top_k": 1})
    after = main.metric("meshyard_serve_batch_size_count", **labels), \
        main.metric("meshyard_serve_batch_size_sum", **labels)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 8)


# -- refusals --------------------------------------------------------------------------------

def _chunked_body():
    yield b'{"prompt": "'
    for _ in range(10):
        yield b"a" * 500  # no Content-Length: the limit is found while reading
    yield b'"}'


REFUSALS = [
    ("POST", GENERATE, {"content": b"{not json"}, 400, "not valid JSON"),
    ("POST", GENERATE, {"json": [1, 2]}, 400, "a JSON array, not an object"),
    ("POST", GENERATE, {"content": b'{"prompt": "' + b"a" * 5000 + b'"}'}, 413, "over the limit"),
    ("POST", GENERATE, {"content": _chunked_body}, 413, "longer than 4096 bytes"),
    ("POST", GENERATE, {"json": {"prompt": "a", "temp": 1}}, 422, 'unknown field "temp"'),
    ("POST", GENERATE, {"json": {"tokens": [1, 300]}}, 422, "tokens[1] = 300 is not a token id"),
    ("POST", GENERATE, {"json": {"tokens": [1] * 60, "max_new_tokens": 10}}, 422,
     "70 in all, over the context of model 'tiny' (64 tokens)"),
    ("POST", GENERATE, {"json": {"tokens": [1], "max_new_tokens": 49}}, 422, "max_new_tokens = 49"),
    ("POST", LOGITS, {"json": {"sequences": [[1] * 65]}}, 422, "sequences[0] has 65 tokens"),
    ("POST", "/v1/models/nope/generate", {"json": {"tokens": [1]}}, 404, "no model is served under the name 'nope'"),
    ("POST", GENERATE, {"json": {"tokens": [1]}, "headers": {"X-Model-Version": "step-0.000000"}}, 404,
     "has no version 'step-0.000000'"),
    ("GET", "/v1/nothing", {}, 404, "there is no route /v1/nothing"),
    ("GET", GENERATE, {}, 405, "GET is not accepted"),
]


@pytest.mark.parametrize("method, path, kwargs, status, fragment", REFUSALS,
                         ids=[f"{r[3]}-{r[4][:24]}" for r in REFUSALS])
def test_bad_requests_get_one_paragraph_and_their_status(main, method, path, kwargs, status, fragment):
    kwargs = {key: value() if callable(value) else value for key, value in kwargs.items()}
    response = httpx.request(method, f"{main.url}{path}", timeout=60.0, **kwargs)
    assert response.status_code == status, main.explain(response)
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert list(response.json()) == ["error"] and fragment in error and "\n" not in error


def test_refusals_are_counted_by_reason(main):
    before = main.metric("meshyard_serve_rejected_total", model="tiny", reason="bad_request")
    post(main, GENERATE, {"tokens": [-1]}, status=422)
    assert main.metric("meshyard_serve_rejected_total", model="tiny", reason="bad_request") == before + 1
    assert main.metric("meshyard_serve_request_seconds_count", model="tiny", endpoint="generate", code="422") >= 1


def test_a_request_past_its_deadline_is_answered_504(main):
    before = main.metric("meshyard_serve_rejected_total", model="tiny", reason="deadline")
    # max_wait_ms is 50: a lone request waits that long for company, past its 1 ms deadline.
    response = post(main, GENERATE, {"tokens": [7, 7, 7], "max_new_tokens": 8, "timeout_ms": 1}, status=504)
    assert "deadline" in response.json()["error"] and response.headers["X-Model-Version"]
    assert main.metric("meshyard_serve_rejected_total", model="tiny", reason="deadline") == before + 1


def test_a_failing_model_answers_500_and_the_server_goes_on(main):
    failed = post(main, "/v1/models/fragile/logits", {"sequences": [[FAILING_TOKEN]]}, status=500)
    assert "internal error" in failed.json()["error"]
    assert f"token {FAILING_TOKEN} breaks this model" in main.log()  # the traceback is in the log
    assert len(post(main, "/v1/models/fragile/logits", {"sequences": [[12]]}).json()["logprobs"][0]) == 97
    assert httpx.get(f"{main.url}/healthz").status_code == 200


def test_a_full_queue_answers_503_with_retry_after(stuck):
    """The stuck server queues 2 items and never fills a batch of 4: of two requests holding 3
    sequences together, one is refused (503), the other waits out its deadline (504)."""
    calls = [("/v1/models/custom/logits", {"sequences": [[1], [2]], "timeout_ms": 2000}, {}),
             ("/v1/models/custom/logits", {"sequences": [[3]], "timeout_ms": 2000}, {})]
    full, late = sorted(concurrently(stuck.url, calls), key=lambda response: response.status_code)
    assert (full.status_code, late.status_code) == (503, 504), stuck.explain(full)
    assert int(full.headers["Retry-After"]) >= 1 and "serve.max_queue = 2" in full.json()["error"]
    assert "deadline" in late.json()["error"]
    assert stuck.metric("meshyard_serve_rejected_total", reason="queue_full") == 1
    assert stuck.metric("meshyard_serve_rejected_total", reason="deadline") == 1


# -- metrics ---------------------------------------------------------------------------------

METRIC_NAMES = ["request_seconds", "queue_wait_seconds", "batch_size", "generated_tokens_total", "tokens_per_second",
                "cache_hits_total", "cache_misses_total", "rejected_total", "in_flight_requests",
                "model_loads_total", "model_evictions_total", "model_bytes", "load_seconds"]


def test_metrics_carry_every_documented_name_with_their_figures(main):
    text = httpx.get(f"{main.url}/metrics").text
    for name in METRIC_NAMES:
        assert f"# TYPE meshyard_serve_{name} " in text, name
    tiny = {"model": "tiny", "endpoint": "generate"}
    assert main.metric("meshyard_serve_generated_tokens_total", **tiny) > 0
    assert main.metric("meshyard_serve_tokens_per_second", **tiny) > 0
    assert main.metric("meshyard_serve_queue_wait_seconds_count", **tiny) > 0
    assert main.metric("meshyard_serve_cache_hits_total", **tiny) >= 2
    assert main.metric("meshyard_serve_model_loads_total", model="tiny") == 1
    assert main.metric("meshyard_serve_model_bytes", model="tiny") > 0
    assert main.metric("meshyard_serve_in_flight_requests") == 0  # every request was answered


# -- the command line --------------------------------------------------------------------------

def _refused(capsys, *argv: str) -> str:
    assert _standalone(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshyard serve: "), err
    if "invalid configuration" not in err:  # settings are listed as every config problem is
        assert err.count("\n") == 1, err  # one paragraph
    return err


def test_command_lines_that_cannot_be_served_exit_2_with_one_paragraph(capsys, trained_run, tmp_path):
    run = str(trained_run)
    assert "does not exist" in _refused(capsys, str(tmp_path / "missing"))
    assert "two models are served under the name 'tiny'" in _refused(capsys, run, run)
    assert "NAME=PATH:WEIGHT" in _refused(capsys, run, "--canary", f"tiny={run}:1.5")
    assert "which 'tiny' already serves" in _refused(capsys, run, "--canary", f"tiny={run}:0.5")
    assert "'other', which is not served" in _refused(capsys, run, "--canary", f"other={run}:0.5")
    assert "--pin other: no model is served" in _refused(capsys, run, "--pin", "other")
    assert "only --serve.FIELD overrides" in _refused(capsys, run, "--train.steps=3")
    assert "serve.cache = 'memcached'" in _refused(capsys, run, "--cache", "memcached")
    assert "serve.max_queue = 0 must be at least 1" in _refused(capsys, run, "--serve.max_queue=0")


def test_a_port_in_use_is_refused(capsys, trained_run):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"cannot listen on 127.0.0.1:{port}" in _refused(capsys, str(trained_run), "--port", str(port))


@pytest.mark.parametrize("missing, argv, needs", [
    ("starlette", [], "meshyard serve needs the 'starlette' package"),
    ("httptools", [], "meshyard serve needs the 'httptools' package"),
    ("redis", ["--cache", "redis://127.0.0.1:1/0"], "serve.cache = 'redis://127.0.0.1:1/0' needs the 'redis' package"),
])
def test_a_missing_optional_package_names_its_extra(missing, argv, needs, capsys, trained_run, monkeypatch):
    monkeypatch.setitem(sys.modules, missing, None)  # what an environment without it imports
    err = _refused(capsys, str(trained_run), *argv)
    assert needs in err and "pip install" in err


@pytest.mark.parametrize("scheduler", ["dynamic", "continuous"])
def test_a_models_footprint_counts_the_kv_cache_its_continuous_batch_keeps(scheduler):
    server = Server(ServeConfig(scheduler=scheduler, max_batch_size=6), Router.from_specs([], []))
    try:
        gpt = EagerEngine(GPT(GPTShape(vocab_size=64, context_length=32, n_layer=2, n_head=2, d_model=16)), 64, 32)
        no_cache = EagerEngine(MLP(64, d_model=8), 64, 32)
        kv_bytes = gpt.module.init_kv_cache(6, 32).bytes  # as the continuous batcher makes it
        assert server.footprint(gpt) == gpt.bytes + (kv_bytes if scheduler == "continuous" else 0)
        assert server.footprint(no_cache) == no_cache.bytes  # served by dynamic batches either way
    finally:
        server.executor.shutdown()


@pytest.mark.parametrize("device, memory, continuously", [
    ("cpu", 80 << 30, False), ("cuda", 80 << 30, True),
    ("cuda", 64 << 10, False),  # a KV cache over a quarter of the device's memory: dynamic batches
])
def test_the_auto_scheduler_batches_continuously_on_a_gpu_only(device, memory, continuously, monkeypatch):
    """``auto``, the default: continuous batching for a model with a KV cache on a CUDA device
    whose memory holds that cache easily (the engine's device and the device's memory are set
    by hand: no GPU here), dynamic batches on the CPU and for models without a KV cache."""
    from meshyard.serve import app

    monkeypatch.setattr(app, "device_memory", lambda _: memory)
    server = Server(ServeConfig(max_batch_size=6), Router.from_specs([], []))
    try:
        assert server.cfg.scheduler == "auto"
        gpt = EagerEngine(GPT(GPTShape(vocab_size=64, context_length=32, n_layer=2, n_head=2, d_model=16)), 64, 32)
        no_cache = EagerEngine(MLP(64, d_model=8), 64, 32)
        gpt.device = no_cache.device = torch.device(device)
        kv_bytes = gpt.module.init_kv_cache(6, 32).bytes
        assert (kv_bytes <= app.AUTO_KV_SHARE * memory) is (device == "cpu" or continuously)
        assert server._runs_continuously(gpt) is continuously
        assert server._runs_continuously(no_cache) is False
        assert server.footprint(gpt) == gpt.bytes + (kv_bytes if continuously else 0)
    finally:
        server.executor.shutdown()

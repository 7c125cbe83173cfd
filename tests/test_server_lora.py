"""LoRA adapters through the server, with the official clients: a request's `model` names an
adapter, /v1/models lists the adapters after the base model, and vLLM's runtime endpoints load
and unload them.

In process (as `test_server.py`): one engine core with LoRA, and two front ends on it, one with
the runtime endpoints (`admin`) and one without (`plain`), so an adapter loaded through one front
end must be found by the other, and one unloaded through a front end must be refused by the
other, whose view is stale (the core's 404). As `tandem serve` processes: the flags (adapters of
--lora-modules in both spellings, two front ends and two data-parallel cores, the environment
variable that allows runtime updates), and a bad start-up adapter that stops the server.

Greedy tokens through an adapter equal transformers + peft's (tests/lora_adapters.py), read back
as ids with vLLM's `return_tokens_as_token_ids`; the base model's equal transformers' alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import ollama
import openai
import pytest
import uvicorn
from test_server import ENGINE_OPTIONS, assert_idle, wait_until
from test_server_processes import ONE_THREAD, Served, clean_up, connection_owner, healthy, spawn

from tandem import EngineConfig, LoRARequest
from tandem.cli import main
from tandem.server.app import create_app
from tandem.server.core import wire
from tandem.server.core.client import CoreClient, CoreEndpoint
from tandem.server.core.lora import (
    CoreAdapters,
    LoraModule,
    parse_lora_module,
    runtime_updating_allowed,
)
from tandem.server.core.process import CoreOptions, start_core, stop_core
from tandem.server.frontend.served_model import ServedModel, load_tokenizer
from tandem.server.frontend.service import GenerationService

from conftest import NUM_SPECIAL_TOKENS, hf_greedy_reference_allowing_near_ties
from lora_adapters import (
    ALL_PROJECTIONS,
    make_adapter,
    make_wrong_shape_adapter,
    peft_greedy_allowing_near_ties,
    remove_adapter_weights,
)

LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
TOKENS = 8
QUESTION = [{"role": "user", "content": "Name a colour."}]


def prompt(seed: int, length: int = 10) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(NUM_SPECIAL_TOKENS, 1024) for _ in range(length)]


PROMPTS = [prompt(1), prompt(2, 14)]


# ----------------------------------------------------------------- harness
@dataclass
class FrontEnd:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    service: GenerationService
    model: ServedModel

    @property
    def name(self) -> str:
        return self.model.model_path.name

    @property
    def stats(self) -> wire.CoreStats:
        """The core's state after its latest step (for `assert_idle`)."""
        stats = self.service.client.stats[0]
        assert stats is not None
        return stats

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server thread did not stop"


def front_end(address: str, pid: int, config: EngineConfig, index: int, **app_options) -> FrontEnd:
    """A front end (uvicorn on a free loopback port, on a thread) for the core at `address`;
    `index` tells the core's socket this process's front ends apart."""
    client = CoreClient([CoreEndpoint(address, pid)], frontend_index=index)
    ready = client.connect(timeout_s=120)
    model = ServedModel(ready, load_tokenizer(ready.model_path), config.model)
    app = create_app(client, model, **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "server start")
    return FrontEnd(f"http://127.0.0.1:{port}", server, thread, app.state.service, model)


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    """Three adapters of tiny_llama (every projection at rank 8, q/v at rank 4, the MLP at rank
    8), and three bad ones: of another model's shapes, without its weights file, of rank 16."""
    root = tmp_path_factory.mktemp("server-lora")
    made = {
        "all8": make_adapter(tiny_llama, root / "all8", rank=8, targets=ALL_PROJECTIONS, seed=1),
        "qv4": make_adapter(tiny_llama, root / "qv4", rank=4, targets=["q_proj", "v_proj"], seed=2),
        "mlp8": make_adapter(
            tiny_llama, root / "mlp8", rank=8, targets=["gate_proj", "up_proj", "down_proj"], seed=3
        ),
        "rank16": make_adapter(tiny_llama, root / "rank16", rank=16, targets=["q_proj"], seed=4),
        "wrong_shape": make_wrong_shape_adapter(root / "wrong_shape"),
    }
    made["missing"] = remove_adapter_weights(shutil.copytree(made["qv4"], root / "missing"))
    return made


@pytest.fixture(scope="module")
def core(tiny_llama: Path) -> Iterator[tuple[str, int, EngineConfig]]:
    config = EngineConfig(model=str(tiny_llama), **ENGINE_OPTIONS, **LORA)
    address = f"ipc://{tempfile.mkdtemp(prefix='tandem-test-')}/core"
    process = start_core(CoreOptions(config, address), "forkserver")
    yield address, process.pid, config
    stop_core(process)


@pytest.fixture(scope="module")
def admin(core) -> Iterator[FrontEnd]:
    """The front end with vLLM's runtime endpoints."""
    server = front_end(*core, 0, allow_runtime_lora_updating=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain(core, admin: FrontEnd) -> Iterator[FrontEnd]:
    """A second front end on the same core, without the runtime endpoints."""
    server = front_end(*core, 1)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def loaded(admin: FrontEnd, adapters: dict[str, Path]) -> list[str]:
    """all8 and qv4, loaded through `admin`."""
    for name in ("all8", "qv4"):
        r = load(admin, name, adapters[name])
        assert r.status_code == 200, r.text
        assert r.text == f"Success: LoRA adapter '{name}' added successfully."
    return ["all8", "qv4"]


def load(server: FrontEnd, name: str, path: Path | str) -> httpx.Response:
    return server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload(server: FrontEnd, name: str) -> httpx.Response:
    return server.post("/v1/unload_lora_adapter", {"lora_name": name})


def completion_ids(client: openai.OpenAI, model: str, prompt_ids: list[int]) -> list[int]:
    """The greedy tokens of a completion, as ids (vLLM's `return_tokens_as_token_ids`)."""
    out = client.completions.create(
        model=model,
        prompt=prompt_ids,
        max_tokens=TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert out.model == model
    assert out.usage.completion_tokens == TOKENS
    return [int(token.removeprefix("token_id:")) for token in out.choices[0].logprobs.tokens]


def check_adapter(base: Path, adapter: Path, prompt_ids: list[int], got: list[int]) -> None:
    want = peft_greedy_allowing_near_ties(base, adapter, prompt_ids, TOKENS, got)
    assert got == want


def models(server: FrontEnd) -> list[dict]:
    return httpx.get(f"{server.url}/v1/models").json()["data"]


def error_of(info: pytest.ExceptionInfo) -> str:
    return info.value.body["message"] if isinstance(info.value.body, dict) else str(info.value)


# ------------------------------------------------------------- unit tests
def test_lora_modules_take_both_of_vllms_spellings() -> None:
    assert parse_lora_module("sql=/a/b") == LoraModule("sql", "/a/b")
    assert parse_lora_module("x=/p=q") == LoraModule("x", "/p=q")
    spec = json.dumps({"name": "sql", "path": "/a", "base_model_name": "llama"})
    assert parse_lora_module(spec) == LoraModule("sql", "/a", "llama")
    assert parse_lora_module('{"name": "s", "path": "/a"}') == LoraModule("s", "/a")
    for bad, why in [
        ("sql", "expected name=path"),
        ("=/a", "expected name=path"),
        ('{"name": "s"}', "must be non-empty strings"),
        ('{"name": "s", "path": "/a", "rank": 4}', "unknown keys rank"),
        ("{nope", "is not JSON"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_lora_module(bad)


def test_runtime_updating_is_off_unless_asked_for() -> None:
    assert not runtime_updating_allowed(False, {})
    assert runtime_updating_allowed(True, {})
    assert runtime_updating_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_updating_allowed(False, {"TANDEM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert not runtime_updating_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    assert not runtime_updating_allowed(False, {"TANDEM_ALLOW_RUNTIME_LORA_UPDATING": "no"})


def test_a_load_reads_its_files_off_the_core_loop() -> None:
    """The core's loop hands a load to its loader thread and answers everything else meanwhile;
    the load's answer comes once the thread is done."""
    loop_thread = threading.current_thread()
    release = threading.Event()

    class SlowAdapters:  # Engine.adapters, whose add takes as long as the test wants
        enabled = True

        def __init__(self) -> None:
            self.held: dict[str, LoRARequest] = {}

        def add(self, request: LoRARequest) -> None:
            assert threading.current_thread() is not loop_thread
            assert release.wait(30)
            self.held[request.lora_name] = request

        def get(self, name: str) -> LoRARequest | None:
            return self.held.get(name)

        def list(self) -> list[LoRARequest]:
            return list(self.held.values())

    adapters = CoreAdapters(SimpleNamespace(adapters=SlowAdapters()))
    try:
        assert adapters.handle(b"fe", wire.LoraLoad(1, "a", "/a")) is None  # at once
        assert adapters.loading and adapters.finished() == []
        again = adapters.handle(b"fe", wire.LoraLoad(2, "a", "/a"))
        assert again is not None and again.status == 400 and "already" in (again.error or "")
        assert adapters.handle(b"fe", wire.LoraList(3)) == wire.LoraAnswer(3, [])
        release.set()
        answers: list = []
        wait_until(lambda: bool(answers.extend(adapters.finished()) or answers), 30, "the load")
        assert answers == [(b"fe", wire.LoraAnswer(1, [wire.LoraCard("a", "/a", 1)]))]
        assert not adapters.loading
    finally:
        release.set()
        adapters.close()


# ------------------------------------------------------------ in process
def test_adapters_match_peft_and_the_base_model_is_unchanged(
    admin: FrontEnd, plain: FrontEnd, tiny_llama: Path, adapters: dict[str, Path], loaded
) -> None:
    """With adapters loaded, and mixed with them in shared steps (three adapters over two
    slots), the base model's tokens are transformers'; each adapter's are peft's, whichever
    front end the request came through."""
    client = admin.client()
    base = {i: completion_ids(client, admin.name, p) for i, p in enumerate(PROMPTS)}
    for i, p in enumerate(PROMPTS):
        assert base[i] == hf_greedy_reference_allowing_near_ties(tiny_llama, p, base[i], TOKENS)
    assert load(admin, "mlp8", adapters["mlp8"]).status_code == 200
    want: dict[tuple[str, int], list[int]] = {}
    for name in ("all8", "qv4", "mlp8"):
        for i, p in enumerate(PROMPTS):
            got = completion_ids(plain.client(), name, p)  # loaded through the other one
            check_adapter(tiny_llama, adapters[name], p, got)
            assert got != base[i], f"{name} changed nothing"
            want[(name, i)] = got
    for i, p in enumerate(PROMPTS):
        assert completion_ids(client, admin.name, p) == base[i]

    async def mixed() -> list[list[int]]:
        aclient = openai.AsyncOpenAI(base_url=f"{admin.url}/v1", api_key="unused", max_retries=0)

        async def one(model: str, p: list[int]) -> list[int]:
            out = await aclient.completions.create(
                model=model, prompt=p, max_tokens=TOKENS, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )  # fmt: skip
            return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

        jobs = [(m, i) for m in (admin.name, "all8", "qv4", "mlp8") for i in range(len(PROMPTS))]
        return await asyncio.gather(*(one(m, PROMPTS[i]) for m, i in jobs * 2))

    outputs = asyncio.run(mixed())
    jobs = [(m, i) for m in (admin.name, "all8", "qv4", "mlp8") for i in range(len(PROMPTS))]
    for (model, i), got in zip(jobs * 2, outputs, strict=True):
        assert got == (base[i] if model == admin.name else want[(model, i)]), (model, i)
    assert unload(admin, "mlp8").status_code == 200
    assert_idle(admin)


def test_models_lists_the_adapters_after_the_base(
    admin: FrontEnd, plain: FrontEnd, loaded: list[str], adapters: dict[str, Path]
) -> None:
    for server in (admin, plain):
        cards = models(server)
        assert cards[0]["id"] == server.name and cards[0]["parent"] is None
        assert [c["id"] for c in cards[1:]] == loaded
        for card in cards[1:]:
            assert card["parent"] == server.name
            assert card["root"] == str(adapters[card["id"]])
            assert card["object"] == "model"
    ids = [m.id for m in plain.client().models.list().data]
    assert ids == [plain.name, *loaded]


def test_every_api_takes_an_adapter_as_its_model(
    admin: FrontEnd, loaded: list[str], tiny_llama: Path
) -> None:
    """Chat completions, the Responses API, Anthropic's messages and Ollama's chat: the same
    conversation through an adapter gives the same answer, named after the adapter; an unknown
    model is a 404 naming it, in each API's error shape."""
    client = admin.client()
    chat = client.chat.completions.create(
        model="all8", messages=QUESTION, max_tokens=TOKENS, temperature=0
    )
    assert chat.model == "all8"
    text = chat.choices[0].message.content
    base_text = (
        client.chat.completions.create(
            model=admin.name, messages=QUESTION, max_tokens=TOKENS, temperature=0
        )
        .choices[0]
        .message.content
    )
    assert text != base_text
    response = client.responses.create(
        model="all8", input=QUESTION[0]["content"], max_output_tokens=TOKENS, temperature=0
    )
    assert response.model == "all8" and response.output_text == text
    claude = anthropic.Anthropic(base_url=admin.url, api_key="unused", max_retries=0)
    message = claude.messages.create(
        model="all8", messages=QUESTION, max_tokens=TOKENS, extra_body={"temperature": 0}
    )
    assert message.model == "all8" and message.content[0].text == text
    llama = ollama.Client(host=admin.url)
    answer = llama.chat(
        model="all8", messages=QUESTION, options={"temperature": 0, "num_predict": TOKENS}
    )
    assert answer.model == "all8" and answer.message.content == text
    tags = [m.model for m in llama.list().models]
    assert tags == [admin.name, *loaded]

    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert "'nope' does not exist" in error_of(info)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=QUESTION, max_tokens=2)
    assert "'nope' does not exist" in error_of(info)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="nope", input="Hi", max_output_tokens=2)
    assert "'nope' does not exist" in error_of(info)
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="nope", messages=QUESTION, max_tokens=2)
    assert "'nope' does not exist" in info.value.message
    r = admin.post("/v1/messages", {"model": "nope", "messages": QUESTION, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    with pytest.raises(ollama.ResponseError) as info:
        llama.chat(model="nope", messages=QUESTION)
    assert info.value.status_code == 404 and "'nope' does not exist" in info.value.error


def test_runtime_load_then_unload(
    admin: FrontEnd, plain: FrontEnd, loaded: list[str], tiny_llama: Path, adapters: dict[str, Path]
) -> None:
    """Load through one front end, use it through the other; unload it through the first, and
    the second, which took it as loaded, answers 404 naming it (its core refuses it); unload
    again: 404 naming it. The same name can be loaded again afterwards."""
    assert load(admin, "temp", adapters["mlp8"]).status_code == 200
    got = completion_ids(plain.client(), "temp", PROMPTS[0])
    check_adapter(tiny_llama, adapters["mlp8"], PROMPTS[0], got)
    assert "temp" in [c["id"] for c in models(plain)]

    r = unload(admin, "temp")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'temp' removed successfully."
    for server in (plain, admin):  # plain's view is stale: the core says 404
        with pytest.raises(openai.NotFoundError) as info:
            server.client().completions.create(model="temp", prompt=PROMPTS[0], max_tokens=2)
        assert "'temp' does not exist" in error_of(info)
    with pytest.raises(openai.NotFoundError) as info:  # streamed: refused before it opens
        list(plain.client().completions.create(model="temp", prompt="Hi", stream=True))
    assert "'temp' does not exist" in error_of(info)
    assert "temp" not in [c["id"] for c in models(plain)]
    r = unload(admin, "temp")
    assert r.status_code == 404 and "'temp'" in r.json()["error"]["message"], r.text

    assert load(admin, "temp", adapters["qv4"]).status_code == 200  # a new folder, same name
    got = completion_ids(plain.client(), "temp", PROMPTS[1])
    check_adapter(tiny_llama, adapters["qv4"], PROMPTS[1], got)
    assert unload(admin, "temp").status_code == 200
    assert_idle(admin)


def test_a_request_whose_adapter_goes_meanwhile_is_a_404(admin: FrontEnd, adapters) -> None:
    """The front end still takes the adapter as loaded (another front end unloaded it): its core
    refuses the request, which becomes a 404 naming the model, and the front end asks again."""
    assert load(admin, "gone", adapters["qv4"]).status_code == 200
    service = admin.service
    unloaded = asyncio.run_coroutine_threadsafe(
        service.client.ask_lora(lambda q: wire.LoraUnload(q, "gone")), service._aloop
    ).result(30)
    assert unloaded[0].error is None
    assert service.adapters.known("gone") is not None  # stale, as another front end's would be
    with pytest.raises(openai.NotFoundError) as info:
        admin.client().completions.create(model="gone", prompt="Hi", max_tokens=2)
    assert "'gone' does not exist" in error_of(info)
    assert service.adapters.known("gone") is None


def test_bad_loads_are_400s_naming_the_problem(
    admin: FrontEnd, loaded: list[str], tiny_llama: Path, adapters: dict[str, Path]
) -> None:
    cases = {
        "missing": "no adapter_model.safetensors in",
        "wrong_shape": "do not fit the base model's",
        "rank16": "rank 16 is above max_lora_rank 8",
    }
    for name, why in cases.items():
        r = load(admin, name, adapters[name])
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert f"LoRA adapter '{name}'" in message and why in message, message
    r = load(admin, "nowhere", "/nonexistent/adapter")
    assert r.status_code == 400 and "no adapter_config.json in /nonexistent" in r.text, r.text
    r = load(admin, "all8", adapters["all8"])
    assert r.status_code == 400 and "'all8' has already been loaded" in r.text, r.text
    r = load(admin, admin.name, adapters["qv4"])
    assert r.status_code == 400 and "names the served model" in r.text, r.text
    r = admin.post("/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and "lora_path" in r.text, r.text

    # Nothing half-loaded, and the server serves on.
    assert [c["id"] for c in models(admin)[1:]] == loaded
    with pytest.raises(openai.NotFoundError):
        admin.client().completions.create(model="rank16", prompt="Hi", max_tokens=2)
    got = completion_ids(admin.client(), "all8", PROMPTS[0])
    check_adapter(tiny_llama, adapters["all8"], PROMPTS[0], got)
    assert completion_ids(admin.client(), admin.name, PROMPTS[0])
    assert_idle(admin)


def test_runtime_endpoints_are_absent_without_the_flag(plain: FrontEnd, loaded) -> None:
    for path, body in [
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}),
        ("/v1/unload_lora_adapter", {"lora_name": "all8"}),
    ]:
        r = plain.post(path, body)
        assert r.status_code == 404, r.text
    assert "all8" in [c["id"] for c in models(plain)]  # nothing was unloaded


# ---------------------------------------------------------- tandem serve
@pytest.fixture(scope="module", autouse=True)
def spawned(
    tiny_llama: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Served]]:
    """The `tandem serve` processes of this module's last two tests, spawned as its first test
    runs, so that their starts (processes importing) overlap with the tests in process:
    "flags", with two front ends and two data-parallel cores, runtime updates allowed by vLLM's
    environment variable, and the start-up adapters all8 and qv4 (in vLLM's two spellings);
    "bad adapter", whose start-up adapter's rank is over --max-lora-rank."""
    logs = tmp_path_factory.mktemp("lora-serve")
    modules = [
        f"all8={adapters['all8']}",
        json.dumps({"name": "qv4", "path": str(adapters["qv4"]), "base_model_name": "base"}),
    ]
    commands = {
        "flags": ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
                  *modules, "--served-model-name", "base", "--api-server-count", "2",
                  "--data-parallel-size", "2", "--cpu-threads", "1"],
        "bad adapter": ["--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                        f"big={adapters['rank16']}", *ONE_THREAD],
    }  # fmt: skip
    servers: dict[str, Served] = {}
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
            servers["flags"] = spawn(tiny_llama, logs / "flags.log", *commands["flags"])
        servers["bad adapter"] = spawn(tiny_llama, logs / "bad.log", *commands["bad adapter"])
        yield servers
    finally:
        for server in servers.values():
            clean_up(server)


def test_serve_flags_two_front_ends_two_cores(
    tiny_llama: Path, adapters: dict[str, Path], spawned: dict[str, Served]
) -> None:
    """`tandem serve --enable-lora --lora-modules` (both spellings) with two front ends and two
    data-parallel cores, runtime updates allowed by vLLM's environment variable: the start-up
    adapters are listed (with the parent JSON named) and answer as peft; one loaded through a
    front end is usable through the other, on both cores; unloaded, it is a 404 on both."""
    with healthy(spawned["flags"]) as server, contextlib.ExitStack() as open_clients:
        cards = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
            ("base", None, cards[0]["root"]),
            ("all8", "base", str(adapters["all8"])),
            ("qv4", "base", str(adapters["qv4"])),
        ]
        said = "LoRA adapters, by the name a request's model gives: all8"
        wait_until(lambda: said in server.output(), 10, "the front ends' start-up lines")
        connection_to: dict[int, httpx.Client] = {}  # an open connection to each front end

        def request(model: str, client: httpx.Client | None = None) -> tuple[int, httpx.Response]:
            """Which front end served it, and its answer; on a new connection, kept open to the
            end, unless `client` gives one. The front ends accept from one socket, so which
            one takes a new connection is a race, but a connection stays with its front end."""
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": TOKENS,
                    "temperature": 0, "logprobs": 0, "ignore_eos": True,
                    "return_tokens_as_token_ids": True}  # fmt: skip
            client = client or open_clients.enter_context(httpx.Client(timeout=60))
            r = client.post(f"{server.url}/v1/completions", json=body)
            port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
            owner = connection_owner(server.port, port, server.frontends)
            connection_to.setdefault(owner, client)
            return owner, r

        def ids(r: httpx.Response) -> list[int]:
            assert r.status_code == 200, r.text
            tokens = r.json()["choices"][0]["logprobs"]["tokens"]
            return [int(t.removeprefix("token_id:")) for t in tokens]

        for name in ("all8", "qv4"):
            check_adapter(tiny_llama, adapters[name], PROMPTS[0], ids(request(name)[1]))

        with httpx.Client(timeout=60) as client:
            r = client.post(f"{server.url}/v1/load_lora_adapter",
                            json={"lora_name": "late", "lora_path": str(adapters["mlp8"])})  # fmt: skip
            assert r.status_code == 200, r.text
            port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
            loader = connection_owner(server.port, port, server.frontends)
        want = None
        served_by = set()
        for _ in range(40):  # until both front ends have answered (each alternates its cores)
            owner, r = request("late")
            if want is None:
                want = ids(r)
                check_adapter(tiny_llama, adapters["mlp8"], PROMPTS[0], want)
            assert ids(r) == want
            served_by.add(owner)
            if len(served_by) == 2 and owner != loader:
                break
        assert served_by == set(server.frontends), "one front end answered every request"

        r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert r.status_code == 200, r.text
        for frontend, client in connection_to.items():
            owner, r = request("late", client)
            assert owner == frontend
            assert r.status_code == 404 and "'late' does not exist" in r.text, r.text


def test_a_bad_start_up_adapter_stops_the_server(
    tiny_llama: Path, adapters: dict[str, Path], spawned: dict[str, Served], capsys
) -> None:
    """A start-up adapter the core cannot load stops the server (status 1, naming it); one
    given without --enable-lora is refused before anything starts (the command line's usage
    error, status 2)."""
    server = spawned["bad adapter"]
    try:
        assert server.proc.wait(240) == 1
        output = server.output()
        assert "tandem serve: --lora-modules: LoRA adapter 'big'" in output, output
        assert "rank 16 is above max_lora_rank 8" in output
    finally:
        clean_up(server)
    status = main(["serve", "--model", str(tiny_llama), "--lora-modules", f"a={adapters['all8']}",
                   "--port", "0"])  # fmt: skip
    stderr = capsys.readouterr().err
    assert status == 2 and "--lora-modules needs --enable-lora" in stderr, stderr

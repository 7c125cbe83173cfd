"""The server's own pages in a real browser (Chromium through Playwright): the chat page at `/`
and the live dashboard at `/dashboard`.

The chat page's streamed answers must equal the API's greedy answers for the same conversation;
stop must end the request on the server; a reasoning model's thinking goes in a closed
<details>; an API key is asked for, kept, and a wrong one refused; copy reaches the clipboard.
The dashboard must show a load as it runs (running requests, a timeline that moves) and, once
idle, the figures /metrics shows. Both pages fetch nothing but the server's own files and data.
The tests write docs/img/chat_page.png and docs/img/dashboard.png every run, so they stay true.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from browser import chromium
from playwright.sync_api import Browser, Page, expect
from test_server import LiveServer, assert_idle, metric_samples, start_server, wait_until

from tandem.models.default_model import default_model_path

from helpers import packaged_model

KEY = "tandem-web-test-key"
OPTIONS = {"max_model_len": 512}
VIEWPORT = {"width": 1100, "height": 750}
IMAGES = Path(__file__).resolve().parents[1] / "docs" / "img"
ANSWER_TIMEOUT_MS = 60_000
# Long enough that the answer arrives over many chunks even if the test process stalls a while:
# the front end sends whatever tokens queued up meanwhile as one chunk.
ANSWER_TOKENS = 96
CHAT_PATH = "/v1/chat/completions"


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def tiny() -> Iterator[LiveServer]:
    """The built-in tiny model (random weights, a real tokenizer and chat template), behind an
    API key."""
    server = start_server(default_model_path(), OPTIONS, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smol() -> Iterator[LiveServer]:
    """SmolLM2-135M-Instruct (the packaged GGUF): real answers for the screenshot."""
    path = packaged_model("smollm2-135m-instruct", "SmolLM2")
    server = start_server(path, {**OPTIONS, "cpu_threads": 2})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def thinker(thinking_qwen3: Path) -> Iterator[LiveServer]:
    """A reasoning model whose thinking the server bounds at 3 tokens unless a request says."""
    override = {"override_generation_config": {"thinking_token_budget": 3}}
    server = start_server(thinking_qwen3, {**OPTIONS, **override})
    yield server
    server.stop()


def model_name(live: LiveServer) -> str:
    return live.model.model_path.name


def api(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=60)


# ------------------------------------------------------------------ the browser's side
class Visit:
    """A page in a fresh browser context, with what it asked the server for."""

    def __init__(self, page: Page, base: str):
        self.page = page
        self.base = base
        self.requests: list = []  # every request the page made
        self.errors: list[str] = []  # uncaught exceptions in the page's scripts
        page.on("request", lambda request: self.requests.append(request))
        page.on("pageerror", lambda error: self.errors.append(str(error)))

    def chat_bodies(self) -> list[dict]:
        """The bodies of the chat completions the page posted, in order."""
        return [
            r.post_data_json
            for r in self.requests
            if r.method == "POST" and r.url == self.base + CHAT_PATH
        ]

    def check(self) -> None:
        outside = [r.url for r in self.requests if not r.url.startswith((self.base + "/", "data:"))]
        assert not outside, f"the page fetched from elsewhere: {outside}"
        assert not self.errors, f"the page's scripts failed: {self.errors}"


@contextmanager
def visit(
    browser: Browser, live: LiveServer, path: str, key: str | None = KEY, **context
) -> Iterator[Visit]:
    """`path` of `live` in a new context (light theme, 1100x750), the API key already in its
    storage unless `key` is None; on leaving, the page must not have fetched from elsewhere nor
    thrown."""
    options = {"viewport": VIEWPORT, "color_scheme": "light", **context}
    ctx = browser.new_context(**options)
    ctx.set_default_timeout(ANSWER_TIMEOUT_MS)
    if key is not None:
        ctx.add_init_script(f"localStorage.setItem('tandem.apiKey', {json.dumps(key)})")
    try:
        page = ctx.new_page()
        seen = Visit(page, live.url)
        page.goto(live.url + path)
        yield seen
        seen.check()
    finally:
        ctx.close()


def open_chat(seen: Visit, live: LiveServer) -> Page:
    page = seen.page
    expect(page.get_by_test_id("model-name")).to_have_text(model_name(live))
    return page


def set_controls(page: Page, **values) -> None:
    """Fill the page's controls by test id (underscores for dashes)."""
    for name, value in values.items():
        page.get_by_test_id(name.replace("_", "-")).fill(str(value))


def send(page: Page, text: str) -> None:
    box = page.get_by_test_id("chat-input")
    box.fill(text)
    box.press("Enter")


def reply(page: Page, index: int, state: str = "done") -> dict:
    """The `index`th assistant message, once it is in `state`: its answer and thinking."""
    message = page.get_by_test_id("message-assistant").nth(index)
    expect(message).to_have_attribute("data-state", state, timeout=ANSWER_TIMEOUT_MS)
    reasoning = message.get_by_test_id("reasoning-text")
    return {
        "answer": message.get_by_test_id("answer").text_content(),
        "reasoning": reasoning.text_content() if reasoning.count() else None,
        "node": message,
    }


def count_text_updates(page: Page) -> None:
    """Count, from now on, each change of the text of the page's messages (a streamed answer
    changes many times; one set at the end, once)."""
    page.evaluate(
        """() => {
        window.__updates = 0;
        new MutationObserver((records) => { window.__updates += records.length; })
          .observe(document.querySelector('[data-testid="messages"]'),
                   {characterData: true, subtree: true});
    }"""
    )


# ------------------------------------------------------------------ chat
def test_chat_streams_the_apis_greedy_answers_turn_after_turn(browser, tiny) -> None:
    """The header names the model and its context; the controls start at /chat/settings'
    sampling and every one is sent; the answer streams in and equals the API's greedy answer
    for the same messages; the second turn sends the whole conversation (the system prompt,
    the first exchange) and its answer equals the API's for that history; Shift+Enter makes a
    new line, Enter sends; "new chat" starts over."""
    settings = httpx.get(f"{tiny.url}/chat/settings", headers={"Authorization": f"Bearer {KEY}"})
    sampling = settings.json()["sampling"]
    system = "You are a terse assistant."
    with visit(browser, tiny, "/") as seen:
        page = open_chat(seen, tiny)
        expect(page.get_by_test_id("context-length")).to_contain_text("512")
        for field in ("temperature", "top_p", "top_k", "min_p"):
            expect(page.get_by_test_id(field.replace("_", "-"))).to_have_value(str(sampling[field]))
        expect(page.get_by_test_id("dashboard-link")).to_have_attribute("href", "/dashboard")

        page.get_by_test_id("system-prompt").fill(system)
        set_controls(page, temperature=0, max_tokens=ANSWER_TOKENS)
        count_text_updates(page)
        send(page, "Hello there")
        first = reply(page, 0)
        assert page.evaluate("window.__updates") > 1, "the answer did not stream"
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Hello there"},
        ]
        expected = api(tiny).chat.completions.create(
            model=model_name(tiny), messages=messages, temperature=0, max_tokens=ANSWER_TOKENS
        )
        assert first["answer"] == expected.choices[0].message.content
        assert first["answer"], "an empty answer proves little"

        body = seen.chat_bodies()[0]
        assert body["messages"] == messages
        assert body["stream"] is True and body["model"] == model_name(tiny)
        assert body["temperature"] == 0 and body["max_tokens"] == ANSWER_TOKENS
        assert {k: body[k] for k in ("top_p", "top_k", "min_p")} == {
            k: sampling[k] for k in ("top_p", "top_k", "min_p")
        }
        assert "seed" not in body  # empty: not sent

        # The second turn, typed over two lines.
        box = page.get_by_test_id("chat-input")
        box.fill("Tell me")
        box.press("Shift+Enter")
        box.press_sequentially("more")
        expect(page.get_by_test_id("message-user")).to_have_count(1)  # not sent yet
        box.press("Enter")
        second = reply(page, 1)
        history = [
            *messages,
            {"role": "assistant", "content": first["answer"]},
            {"role": "user", "content": "Tell me\nmore"},
        ]
        assert seen.chat_bodies()[1]["messages"] == history
        expected = api(tiny).chat.completions.create(
            model=model_name(tiny), messages=history, temperature=0, max_tokens=ANSWER_TOKENS
        )
        assert second["answer"] == expected.choices[0].message.content

        page.get_by_test_id("new-chat").click()
        expect(page.get_by_test_id("message-assistant")).to_have_count(0)
        send(page, "Hello there")
        assert reply(page, 0)["answer"] == first["answer"]
        assert seen.chat_bodies()[2]["messages"] == messages


def test_errors_are_shown_and_the_message_can_be_sent_again(browser, tiny) -> None:
    """A request the server refuses (400): the page shows the server's own message, keeps the
    turn out of the conversation and gives the text back to send again."""
    refused = httpx.post(
        f"{tiny.url}{CHAT_PATH}",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": model_name(tiny), "messages": [{"role": "user", "content": "Hi"}],
              "temperature": -1, "stream": True},
    )  # fmt: skip
    assert refused.status_code == 400
    with visit(browser, tiny, "/") as seen:
        page = open_chat(seen, tiny)
        set_controls(page, temperature=-1, max_tokens=8)
        send(page, "Hi")
        failed = reply(page, 0, "error")["node"]
        expect(failed.get_by_test_id("error")).to_have_text(refused.json()["error"]["message"])
        expect(page.get_by_test_id("chat-input")).to_have_value("Hi")
        set_controls(page, temperature=0)
        page.get_by_test_id("chat-input").press("Enter")
        reply(page, 1)
        # The failed turn is not part of the conversation.
        assert seen.chat_bodies()[1]["messages"] == [{"role": "user", "content": "Hi"}]


def test_stop_ends_the_reply_and_frees_its_request(browser, smol) -> None:
    """Stop mid-answer: the server aborts the request (nothing running or in flight after, one
    more abort counted), the partial answer stays, marked stopped, and is part of the
    conversation; the next message is answered."""
    abort = ("tandem_requests_finished_total", (("finish_reason", "abort"),))
    aborted = metric_samples(smol.url).get(abort, 0.0)
    with visit(browser, smol, "/", key=None) as seen:
        page = open_chat(seen, smol)
        set_controls(page, temperature=0, max_tokens=400)
        page.locator("details.advanced summary").click()
        page.get_by_test_id("extra-body").fill('{"ignore_eos": true}')
        send(page, "Write a long story about a lighthouse keeper.")
        message = page.get_by_test_id("message-assistant").nth(0)
        expect(message).to_have_attribute("data-state", "streaming")
        expect(message.get_by_test_id("answer")).not_to_be_empty()
        wait_until(lambda: smol.stats.num_running == 1, 30, "the reply running")
        page.get_by_test_id("stop").click()
        stopped = reply(page, 0, "stopped")
        assert_idle(smol)
        samples = metric_samples(smol.url)
        assert samples[("tandem_requests_in_flight", ())] == 0
        assert samples[("tandem_requests_running", (("engine", "0"),))] == 0
        wait_until(
            lambda: metric_samples(smol.url).get(abort, 0.0) == aborted + 1, 5, "abort counted"
        )
        expect(stopped["node"].get_by_test_id("stopped-badge")).to_be_visible()
        assert stopped["answer"]
        assert stopped["node"].get_attribute("data-finish-reason") is None  # it did not end
        # The answer no longer grows.
        time.sleep(0.3)
        assert message.get_by_test_id("answer").text_content() == stopped["answer"]

        set_controls(page, max_tokens=8)
        send(page, "Thanks!")
        after = reply(page, 1)
        assert after["answer"]
        assert seen.chat_bodies()[1]["messages"][1] == {
            "role": "assistant",
            "content": stopped["answer"],
        }


def test_reasoning_is_folded_above_the_answer(browser, thinker) -> None:
    """A reasoning model: its thinking streams into a closed <details> above the answer, each
    equal to the API's `reasoning_content` and `content`; the thinking controls appear (the
    server's budget as the default) and turning thinking off sends the template's switch."""
    with visit(browser, thinker, "/", key=None) as seen:
        page = open_chat(seen, thinker)
        expect(page.get_by_test_id("thinking-budget")).to_have_value("3")
        expect(page.get_by_test_id("thinking-toggle")).to_be_checked()
        set_controls(page, temperature=0, max_tokens=12)
        send(page, "Hi")
        got = reply(page, 0)
        messages = [{"role": "user", "content": "Hi"}]
        expected = api(thinker).chat.completions.create(
            model=model_name(thinker), messages=messages, temperature=0, max_tokens=12
        ).choices[0].message  # fmt: skip
        assert got["reasoning"] == expected.model_extra["reasoning_content"]
        assert got["reasoning"], "the model was to think first"
        assert got["answer"] == expected.content
        details = got["node"].get_by_test_id("reasoning")
        expect(details).not_to_have_attribute("open", "")
        expect(got["node"].get_by_test_id("reasoning-text")).to_be_hidden()
        assert details.evaluate("d => d.nextElementSibling.dataset.testid") == "answer"
        details.locator("summary").click()
        expect(got["node"].get_by_test_id("reasoning-text")).to_be_visible()
        assert seen.chat_bodies()[0]["thinking_token_budget"] == 3
        # The history holds the answer only.
        page.get_by_test_id("thinking-toggle").uncheck()
        send(page, "Again")
        off = reply(page, 1)
        body = seen.chat_bodies()[1]
        assert body["messages"][1] == {"role": "assistant", "content": got["answer"]}
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
        assert off["reasoning"] is None


def test_the_api_key_is_asked_for_kept_and_checked(browser, tiny) -> None:
    """Without a key the page asks for one (the server refuses the page's calls without it); a
    wrong key is refused and the page says so; the right one is kept and the chat works; the
    dashboard then uses the same key."""
    with visit(browser, tiny, "/", key=None) as seen:
        page = seen.page
        dialog = page.get_by_test_id("api-key-dialog")
        expect(dialog).to_be_visible()
        assert page.evaluate("fetch('/chat/settings').then(r => r.status)") == 401
        assert page.evaluate("fetch('/dashboard/data').then(r => r.status)") == 401
        page.get_by_test_id("api-key-input").fill("not-the-key")
        page.get_by_test_id("api-key-submit").click()
        expect(page.get_by_test_id("api-key-error")).to_contain_text("incorrect API key")
        expect(page.get_by_test_id("api-key-error")).to_contain_text("refused")
        expect(dialog).to_be_visible()
        page.get_by_test_id("api-key-input").fill(KEY)
        page.get_by_test_id("api-key-submit").click()
        expect(dialog).to_be_hidden()
        open_chat(seen, tiny)
        assert page.evaluate("localStorage.getItem('tandem.apiKey')") == KEY
        set_controls(page, temperature=0, max_tokens=8)
        send(page, "Hi")
        reply(page, 0)
        sent = [r for r in seen.requests if r.url == tiny.url + CHAT_PATH]
        assert [r.headers.get("authorization") for r in sent] == [f"Bearer {KEY}"]

        # Kept: the dashboard reads its data with it, asking nothing.
        page.get_by_test_id("dashboard-link").click()
        expect(page.get_by_test_id("engine-0-kv-total")).to_have_attribute("data-value", "256")
        expect(dialog).to_have_count(0)

        # A stored key the server refuses: asked again, and told why.
        page.evaluate("localStorage.setItem('tandem.apiKey', 'stale')")
        page.goto(tiny.url + "/")
        expect(page.get_by_test_id("api-key-error")).to_contain_text("incorrect API key")
        page.get_by_test_id("api-key-input").fill(KEY)
        page.get_by_test_id("api-key-input").press("Enter")
        open_chat(seen, tiny)

        # The key can be forgotten: the page asks again.
        page.get_by_test_id("api-key-button").click()
        page.get_by_test_id("api-key-forget").click()
        assert page.evaluate("localStorage.getItem('tandem.apiKey')") is None
        expect(page.get_by_test_id("api-key-button")).to_be_hidden()
        page.reload()
        expect(dialog).to_be_visible()


@pytest.mark.parametrize("clipboard_api", [True, False], ids=["clipboard-api", "fallback"])
def test_copy_puts_the_answer_on_the_clipboard(browser, tiny, clipboard_api: bool) -> None:
    """Copy: through navigator.clipboard, and where there is none (plain http on another host
    than localhost) through a selected textarea and execCommand."""
    hide = """
        window.__clipboard = navigator.clipboard;
        Object.defineProperty(Navigator.prototype, 'clipboard', {get: () => undefined});
    """
    with visit(
        browser, tiny, "/", permissions=["clipboard-read", "clipboard-write"]
    ) as seen:  # fmt: skip
        page = seen.page
        if not clipboard_api:
            page.add_init_script(hide)
            page.reload()
            assert page.evaluate("navigator.clipboard") is None
        open_chat(seen, tiny)
        set_controls(page, temperature=0, max_tokens=16)
        page.get_by_test_id("system-prompt").fill("Copy test")
        send(page, "Say something")
        got = reply(page, 0)
        copy = got["node"].get_by_test_id("copy")
        copy.click()
        expect(copy).to_have_attribute("data-copied", "yes")
        clipboard = "window.__clipboard || navigator.clipboard"
        assert page.evaluate(f"({clipboard}).readText()") == got["answer"]


# ------------------------------------------------------------------ dashboard
def dashboard_values(page: Page) -> dict[str, float]:
    names = ["engine-0-running", "engine-0-waiting", "engine-0-kv-used", "engine-0-kv-cached",
             "engine-0-generation-tokens", "server-generation-tokens", "server-in-flight"]  # fmt: skip
    return {
        name: float(page.get_by_test_id(name).get_attribute("data-value") or "nan")
        for name in names
    }


def metrics_values(url: str) -> dict[str, float]:
    s = metric_samples(url)
    engine = (("engine", "0"),)
    return {
        "engine-0-running": s[("tandem_requests_running", engine)],
        "engine-0-waiting": s[("tandem_requests_waiting", engine)],
        "engine-0-kv-used": s[("tandem_kv_blocks_used", engine)],
        "engine-0-kv-cached": s[("tandem_kv_blocks_cached", engine)],
        "engine-0-generation-tokens": s[("tandem_engine_generation_tokens_total", engine)],
        "server-generation-tokens": s[("tandem_generation_tokens_total", ())],
        "server-in-flight": s[("tandem_requests_in_flight", ())],
    }


class Load:
    """16 clients streaming chat completions back to back, on a thread, until stopped."""

    def __init__(self, live: LiveServer, clients: int = 16, max_tokens: int = 200):
        self.live = live
        self.clients = clients
        self.max_tokens = max_tokens
        self.stopping = threading.Event()
        self.answers: list[int] = []  # tokens streamed per request
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(120)
        assert not self.thread.is_alive(), "the load did not end"
        if self.error is not None and exc[0] is None:
            raise self.error

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # reported by __exit__
            self.error = error

    async def _main(self) -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{self.live.url}/v1", api_key=KEY, max_retries=0, timeout=120
        )

        async def one(i: int) -> None:
            while not self.stopping.is_set():
                stream = await client.chat.completions.create(
                    model=model_name(self.live),
                    messages=[{"role": "user", "content": f"Tell me a story, number {i}."}],
                    max_tokens=self.max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                count = 0
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        count += 1
                self.answers.append(count)

        async with client:
            await asyncio.gather(*(one(i) for i in range(self.clients)))


def test_dashboard_follows_a_load_and_matches_metrics_when_idle(browser, tiny) -> None:
    """Under 16 concurrent streams the dashboard shows requests running and a timeline whose
    latest step moves on; the window can be changed; once the load is over the page's figures
    equal /metrics' (running, waiting, KV blocks used and cached, tokens generated)."""
    assert_idle(tiny)
    with visit(browser, tiny, "/dashboard") as seen:
        page = seen.page
        expect(page.get_by_test_id("model-name")).to_have_text(model_name(tiny))
        expect(page.get_by_test_id("engine-0-execution")).not_to_be_empty()
        timeline = page.get_by_test_id("engine-0-timeline")
        with Load(tiny):
            wait_until(lambda: tiny.stats.num_running > 0, 30, "the load running")
            page.wait_for_function(
                """() => Number(document.querySelector('[data-testid="engine-0-running"]')
                               .dataset.value) > 0"""
            )
            canvas = "document.querySelector('[data-testid=\"engine-0-timeline\"]')"
            page.wait_for_function(f"() => {canvas}.dataset.lastStep !== undefined")
            before = int(timeline.get_attribute("data-last-step"))
            page.wait_for_function(f"() => Number({canvas}.dataset.lastStep) > {before}")
            for window in ("0.25", "10", "1"):
                button = page.get_by_test_id(f"engine-0-window-{window}")
                button.click()
                expect(button).to_have_attribute("aria-pressed", "true")
            assert int(timeline.get_attribute("data-steps-shown")) > 0
            page.wait_for_function(
                """() => Number(document.querySelector('[data-testid="server-tokens-per-s"]')
                               .dataset.value) > 0"""
            )
            IMAGES.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=IMAGES / "dashboard.png")
        assert_idle(tiny)
        deadline = time.monotonic() + 10
        while (shown := dashboard_values(page)) != (served := metrics_values(tiny.url)):
            assert time.monotonic() < deadline, f"the page shows {shown}, /metrics {served}"
            time.sleep(0.1)
        assert served["engine-0-running"] == 0 and served["server-generation-tokens"] > 0
        polls = [r for r in seen.requests if r.url.startswith(tiny.url + "/dashboard/data")]
        assert "after=" not in polls[0].url and all("after=" in r.url for r in polls[1:])


# ------------------------------------------------------------------ the screenshot
def test_a_real_conversation_for_the_screenshot(browser, smol) -> None:
    """SmolLM2 answers two questions on the page, each as the API does, greedy; the page is
    photographed for the docs."""
    questions = ["What is the capital of France?", "Name three famous landmarks there."]
    with visit(browser, smol, "/", key=None) as seen:
        page = open_chat(seen, smol)
        set_controls(page, temperature=0, max_tokens=120)
        history: list[dict] = []
        for i, question in enumerate(questions):
            send(page, question)
            answer = reply(page, i)["answer"]
            history.append({"role": "user", "content": question})
            expected = api(smol).chat.completions.create(
                model=model_name(smol), messages=history, temperature=0, max_tokens=120
            )
            assert answer == expected.choices[0].message.content
            history.append({"role": "assistant", "content": answer})
        assert "Paris" in history[1]["content"]
        page.get_by_test_id("chat-input").fill("")
        page.mouse.move(0, 0)
        IMAGES.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=IMAGES / "chat_page.png")

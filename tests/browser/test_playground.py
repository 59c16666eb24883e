"""The playground in a real headless chromium against the live stack (tests/browser/conftest.py).

What a user does — send, watch it stream, stop, regenerate, edit, attach an image, call a tool,
compare, read the engine panel, give a key — checked on the page's DOM and on what the engine
saw (its counters and log), never on client-side timings.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.browser.conftest import TEXT, VLM, Session, open_playground, wait_for_models
from tests.helpers import Engine, Frontend, png

pytestmark = pytest.mark.browser

PAGE_BUDGET = 150_000  # bytes the page's own files may weigh, uncompressed
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"], "additionalProperties": False}}}]

# Records the length of the streaming answer's text at every DOM change.
OBSERVE = """() => {
  window.__lengths = [];
  const list = document.getElementById('messages');
  new MutationObserver(() => {
    const nodes = list.querySelectorAll('.msg.assistant .content');
    const last = nodes[nodes.length - 1];
    if (last) window.__lengths.push(last.textContent.length);
  }).observe(list, {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture()
def session(chromium: Any, browser_stack: tuple[Engine, Frontend]) -> Iterator[Session]:
    opened = open_playground(chromium, browser_stack[1].base_url)
    wait_for_models(opened.page)
    yield opened
    opened.page.context.close()
    assert opened.errors == [], opened.errors


def set_field(page: Any, name: str, value: str) -> None:
    page.fill(f"#settings [name={name}]", value)


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_answer(page: Any, count: int = 1, timeout: float = 60_000) -> Any:
    """The `count`-th assistant message once its stream has ended (its figures line is written)."""
    page.wait_for_function(
        """(n) => { const m = document.querySelectorAll('.msg.assistant');
                   return m.length >= n && !document.querySelector('#send').disabled
                     && m[n - 1].querySelector('.meta').textContent.length > 0; }""", arg=count, timeout=timeout)
    return page.locator(".msg.assistant").nth(count - 1)


def engine_stats(frontend: Frontend) -> dict[str, Any]:
    return httpx.get(f"{frontend.base_url}/stats", timeout=10).json()


def test_answer_streams_in_and_the_history_is_sent(session: Session) -> None:
    page = session.page
    set_field(page, "max_tokens", "160")
    set_field(page, "temperature", "0")
    page.fill("#system", "You are terse.")
    page.evaluate(OBSERVE)
    send(page, "Tell me a story.")
    answer = wait_answer(page)
    final = len(answer.locator(".content").text_content())
    lengths = page.evaluate("window.__lengths")
    partial = sorted({n for n in lengths if 0 < n < final})
    # Seen growing, not only at the end. Two partial lengths at least: on a loaded CI machine the browser
    # took the tiny model's 160 tokens in three tasks (lengths 1, 563, then the final 875).
    assert final > 0 and len(partial) >= 2, (final, lengths)
    meta = answer.locator(".meta").text_content()
    assert "prompt " in meta and "completion 160" in meta and "TTFT" in meta and "tok/s" in meta, meta
    assert page.locator(".msg.user").first.text_content().count("Tell me a story.") == 1

    send(page, "And then?")
    wait_answer(page, 2)
    first, second = session.chat_bodies()
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["max_tokens"] == 160 and first["temperature"] == 0 and first["model"] == TEXT
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][0]["content"] == "You are terse."
    assert second["messages"][2]["role"] == "assistant" and second["messages"][2]["content"]
    # The second turn's prompt starts with the first's: the engine's prefix cache served part of it.
    assert "cached " in page.locator(".msg.assistant").nth(1).locator(".meta").text_content()


def test_regenerate_and_edit_and_resend(session: Session) -> None:
    page = session.page
    set_field(page, "max_tokens", "12")
    send(page, "First question")
    wait_answer(page)
    page.get_by_role("button", name="Regenerate").click()
    wait_answer(page)
    assert page.locator(".msg").count() == 2
    page.locator(".msg.user").get_by_role("button", name="Edit").click()
    page.get_by_label("Edit message").fill("Second question")
    page.get_by_role("button", name="Save & send").click()
    wait_answer(page)
    bodies = session.chat_bodies()
    assert len(bodies) == 3
    assert bodies[1]["messages"] == bodies[0]["messages"]  # regenerate: the same request again
    assert bodies[2]["messages"][-1] == {"role": "user", "content": "Second question"}
    assert page.locator(".msg").count() == 2


def test_stop_closes_the_stream_and_the_engine_aborts(session: Session,
                                                      browser_stack: tuple[Engine, Frontend]) -> None:
    engine, frontend = browser_stack
    page = session.page
    before = engine_stats(frontend)
    set_field(page, "max_tokens", "3000")
    set_field(page, "temperature", "0")
    send(page, "Go on forever.")
    page.wait_for_function("() => document.querySelector('.msg.assistant .content')?.textContent.length > 20")
    page.get_by_role("button", name="Stop").click()
    answer = wait_answer(page)
    assert "stopped" in answer.locator(".meta").text_content()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = engine_stats(frontend)
        if now["requests_aborted"] > before["requests_aborted"] and now["running"] == 0:
            break
        time.sleep(0.1)
    assert now["requests_aborted"] == before["requests_aborted"] + 1, now
    assert now["tokens_generated"] - before["tokens_generated"] < 3000
    assert "aborted 1 request(s) (client_disconnected)" in engine.log()
    page.wait_for_selector("#send:not([disabled])")


def test_tool_call_shows_as_a_card(session: Session) -> None:
    page = session.page
    page.click("#tools-section summary")
    page.fill("#tools", json.dumps(TOOLS))
    page.select_option("#tool_choice", "required")
    # One call: random weights would otherwise keep appending parallel calls until max_tokens.
    page.uncheck("#settings [name=parallel_tool_calls]")
    set_field(page, "max_tokens", "120")
    set_field(page, "temperature", "0")
    send(page, "What is the weather in Paris?")
    answer = wait_answer(page)
    card = answer.locator(".tool-card").first
    assert card.locator(".tool-name").text_content() == "get_weather"
    arguments = json.loads(card.locator(".tool-args").text_content())
    assert isinstance(arguments["city"], str)
    assert "finish: tool_calls" in answer.locator(".meta").text_content()
    body = session.chat_bodies()[0]
    assert body["tools"] == TOOLS and body["tool_choice"] == "required" and body["parallel_tool_calls"] is False


def test_image_attached_to_the_vision_model(session: Session) -> None:
    page = session.page
    page.select_option("#model", VLM)
    assert "vision" in page.locator("#model-info").text_content()
    set_field(page, "max_tokens", "8")
    image = png(2)
    page.set_input_files("#file-input", files=[{"name": "noise.png", "mimeType": "image/png", "buffer": image}])
    page.wait_for_selector("#attachments .chip img")
    # and one more by drag-and-drop onto the page
    page.evaluate("""(bytes) => {
        const transfer = new DataTransfer();
        transfer.items.add(new File([new Uint8Array(bytes)], 'dropped.png', {type: 'image/png'}));
        document.body.dispatchEvent(new DragEvent('drop', {dataTransfer: transfer, bubbles: true, cancelable: true}));
    }""", list(png(5)))
    page.wait_for_function("() => document.querySelectorAll('#attachments .chip').length === 2")
    send(page, "Describe this image.")
    answer = wait_answer(page, timeout=120_000)
    assert answer.locator(".error").is_hidden(), answer.locator(".error").text_content()
    assert "completion 8" in answer.locator(".meta").text_content()
    parts = session.chat_bodies()[0]["messages"][-1]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "image_url"]
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert page.locator(".msg.user img.thumb").count() == 2
    page.select_option("#model", TEXT)  # leave the text model chosen for the next test's localStorage


def test_compare_streams_two_settings_side_by_side(session: Session) -> None:
    page = session.page
    set_field(page, "max_tokens", "10")
    page.get_by_role("tab", name="Compare").click()
    page.fill("#compare-A-temperature", "0")
    page.fill("#compare-B-temperature", "1.5")
    page.fill("#compare-B-seed", "7")
    page.fill("#compare-prompt", "Say something.")
    page.get_by_role("button", name="Run both").click()
    for side in ("A", "B"):
        page.wait_for_function(f"() => document.querySelector('[aria-label=\"Side {side}\"] .meta')"
                               "?.textContent.includes('completion 10')")
    a, b = session.chat_bodies()[-2:]
    assert {a["temperature"], b["temperature"]} == {0, 1.5}
    assert a["messages"] == b["messages"]


def test_engine_panel_follows_the_engine(session: Session, browser_stack: tuple[Engine, Frontend]) -> None:
    page = session.page
    page.wait_for_function("() => document.querySelector('#health').dataset.state === 'ready'")
    polls = int(page.locator("#stats").get_attribute("data-polls"))
    page.wait_for_function(f"() => +document.querySelector('#stats').dataset.polls >= {polls + 2}")
    shown = int(page.locator("[data-key=tokens-generated]").text_content())
    set_field(page, "max_tokens", "25")
    send(page, "Count.")
    wait_answer(page)
    page.wait_for_function(f"() => +document.querySelector('[data-key=tokens-generated]').textContent >= {shown + 25}")
    assert int(page.locator("[data-key=requests]").text_content()) >= 1
    assert page.locator("#stats dt", has_text="Cache hit rate").count() == 1


MALICIOUS = ("Here: <script>window.__pwned = 'script'</script> and <img src=x onerror=\"window.__pwned='img'\"> "
             "[click](javascript:window.__pwned='link') **bold** `<b>code</b>`\n\n"
             "```html\n<script>window.__pwned = 'fenced'</script>\n```\n")


def test_model_text_is_shown_as_text_never_run(session: Session) -> None:
    page = session.page
    # The renderer on its own: no element but its own, the markup as characters.
    result = page.evaluate("""async (text) => {
        const { renderMarkdown } = await import('./playground/markdown.js');
        const box = document.createElement('div');
        box.append(renderMarkdown(text));
        document.body.append(box);
        await new Promise((r) => setTimeout(r, 300));
        return { tags: [...box.querySelectorAll('*')].map((n) => n.tagName.toLowerCase()),
                 text: box.textContent, links: [...box.querySelectorAll('a')].map((a) => a.href),
                 attrs: [...box.querySelectorAll('*')].flatMap((n) => [...n.attributes].map((a) => a.name)) };
    }""", MALICIOUS)
    assert not {"script", "img", "iframe", "b"} & set(result["tags"]), result["tags"]
    assert "<script>window.__pwned = 'script'</script>" in result["text"]
    assert "<img src=x onerror=" in result["text"] and "<b>code</b>" in result["text"]
    assert result["links"] == [] and not any(a.startswith("on") for a in result["attrs"])
    # Through the whole page: a stream from the server whose content and reasoning carry markup.
    chunks = [{"choices": [{"index": 0, "delta": {"reasoning_content": "<img src=y onerror=\"window.__pwned='r'\">"}}]},
              *({"choices": [{"index": 0, "delta": {"content": MALICIOUS[i:i + 7]}}]}
                for i in range(0, len(MALICIOUS), 7)),
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 40, "total_tokens": 43}}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse))
    send(page, "Say something dangerous.")
    answer = wait_answer(page)
    assert answer.locator("script, img, iframe").count() == 0
    assert "<script>window.__pwned = 'fenced'</script>" in answer.locator("figure.code code").text_content()
    reasoning = answer.locator("details.reasoning")
    assert reasoning.get_attribute("open") is None  # collapsed apart from the answer
    assert "<img src=y" in reasoning.locator(".reasoning-body").text_content()
    assert page.evaluate("window.__pwned") is None


def test_page_budget_and_only_its_own_origin(session: Session, browser_stack: tuple[Engine, Frontend]) -> None:
    page = session.page
    page.wait_for_function("() => +document.querySelector('#stats').dataset.polls >= 2")
    origin = urlsplit(browser_stack[1].base_url)
    foreign = [r.url for r in session.requests if urlsplit(r.url)[:2] != origin[:2]]
    assert foreign == []
    files = [r for r in session.requests if r.resource_type in ("document", "script", "stylesheet", "image", "font")]
    sizes = {r.url: r.sizes()["responseBodySize"] for r in files}
    assert {urlsplit(u).path for u in sizes} >= {"/", "/playground/app.js", "/playground/style.css",
                                                  "/playground/markdown.js", "/playground/icon.svg"}
    total = sum(sizes.values())
    print(f"playground page: {len(sizes)} files, {total} bytes")
    assert 0 < total < PAGE_BUDGET, sizes


def test_a_key_is_asked_for_and_kept_for_the_tab(chromium: Any, browser_stack: tuple[Engine, Frontend],
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    engine, _ = browser_stack
    key = "sk-browser-test"
    frontend = Frontend(engine.endpoint, tmp_path_factory.mktemp("keyed") / "frontend.log", workers=1,
                        args=["--api-key", key])
    try:
        frontend.wait_healthy()
        assert httpx.get(f"{frontend.base_url}/", timeout=10).status_code == 200  # the page itself: no key
        opened = open_playground(chromium, frontend.base_url)
        page = opened.page
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", key)
        page.click("#key-save")
        wait_for_models(page)
        assert page.evaluate("sessionStorage.getItem('mlx-engined.api-key')") == key
        page.wait_for_function("() => +document.querySelector('#stats').dataset.polls >= 2")
        page.wait_for_function("() => document.querySelector('[data-key=running]') !== null")
        stats_requests = [r for r in opened.requests if urlsplit(r.url).path == "/stats"]
        assert stats_requests[-1].headers.get("authorization") == f"Bearer {key}"
        # The 401s before the key was given are the only console errors (chromium logs failed loads).
        assert all("401" in e for e in opened.errors), opened.errors
        opened.page.context.close()
    finally:
        frontend.stop()


def test_theme_follows_the_system_then_the_toggle(chromium: Any, browser_stack: tuple[Engine, Frontend]) -> None:
    opened = open_playground(chromium, browser_stack[1].base_url, color_scheme="dark")
    page = opened.page
    wait_for_models(page)
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    page.get_by_role("button", name="Switch to light theme").click()
    assert page.evaluate("document.documentElement.dataset.theme") == "light"
    page.reload()
    wait_for_models(page)
    assert page.evaluate("document.documentElement.dataset.theme") == "light"  # the choice is remembered
    assert opened.errors == []
    opened.page.context.close()


def test_every_control_has_a_name_and_the_keyboard_reaches_the_composer(session: Session) -> None:
    page = session.page
    unnamed = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
        .filter((e) => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                       && !(e.tagName === 'BUTTON' && e.textContent.trim()))
        .map((e) => e.outerHTML.slice(0, 80))""")
    assert unnamed == []
    assert page.evaluate("document.activeElement.id") == "prompt"  # focus starts in the message box
    page.keyboard.type("Hi")
    page.fill("#settings [name=max_tokens]", "5")
    page.focus("#prompt")
    page.keyboard.press("Enter")
    assert "completion 5" in wait_answer(page).locator(".meta").text_content()

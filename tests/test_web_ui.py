"""The web page at / (issue 29) in headless Chromium (Debian's `chromium`, driven by
Playwright with executable_path: no browser download), against a real server on the default
model: chat streams an answer, Stop aborts it server-side, a repeated system prompt is a
prefix-cache hit the page shows, the dashboard shows /metrics' numbers, a reload keeps the
chat, and with an API key the page asks for it and loads nothing without it. The tests write
the screenshots in docs/images (shown in the README)."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from live_server import serving, tiny_llm
from patience import patience

IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 12


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("Debian's chromium is not installed: the README's test command installs it")
    return path


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def live():
    from pypto_serving import LLM

    with LLM("default", enforce_eager=True) as llm, serving(llm, "SmolLM2") as live:
        yield live


def settings(page, system: str = "", temperature: float = 0.0, max_tokens: int = 40) -> None:
    page.click("#open-settings")
    page.fill("#system-prompt", system)
    page.fill("#temperature", str(temperature))
    page.fill("#max-tokens", str(max_tokens))
    page.click("#settings-form button[type=submit]")


def ask(page, text: str, wait: bool = True) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    if wait:
        page.wait_for_selector("#send:not([disabled])", timeout=patience(120) * 1000)


def replies(page) -> list[str]:
    return page.locator("#messages li.assistant").all_inner_texts()


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^pypto_{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def finished(url: str) -> float:
    """Requests finished, whatever their reason."""
    text = httpx.get(url + "/metrics").text
    return sum(
        float(v) for v in re.findall(r"^pypto_request_success_total\{[^}]*\} (\S+)$", text, re.M)
    )


@pytest.mark.slow
def test_chat_stop_cache_dashboard_and_reload(browser, live):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(live.url + "/")
    page.wait_for_selector("#model-name:has-text('SmolLM2')")
    settings(page)
    ask(page, "What is the capital of France?")
    assert "Paris" in replies(page)[-1]
    assert re.search(r"prompt \d+ tok · cached \d+ \(device \d+", replies(page)[-1])
    assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s", replies(page)[-1])

    # Stop: the server aborts the request, and its running count drops to 0
    settings(page, temperature=0.8, max_tokens=2000)
    ask(page, "Write a very long story about a dragon and a knight.", wait=False)
    page.wait_for_function(
        "document.querySelector('#messages li.assistant:last-child').innerText.length > 40",
        timeout=patience(60) * 1000,
    )
    page.click("#stop")
    page.wait_for_selector("#send:not([disabled])")
    assert "stopped" in replies(page)[-1]
    page.wait_for_selector("#dash-running:text-is('0')", timeout=patience(10) * 1000)
    assert metric(live.url, "num_requests_running") == 0

    # the same long system prompt twice: the second reply's prompt is a prefix-cache hit
    settings(page, system=SYSTEM)
    page.click("#new-chat")
    ask(page, "Hello!")
    page.click("#new-chat")
    ask(page, "Hi there!")
    cached = re.search(r"cached (\d+) \(device (\d+)", replies(page)[-1])
    assert cached and int(cached.group(1)) > 0 and int(cached.group(2)) > 0

    # the dashboard shows /metrics' numbers (nothing runs now: they hold still)
    generated = metric(live.url, "generation_tokens_total")
    refresh = patience(5) * 1000  # one refresh (1 s), on a loaded machine
    page.wait_for_selector(f"#dash-generated:text-is('{int(generated)}')", timeout=refresh)
    hits, queries = (metric(live.url, f"prefix_cache_{k}_total") for k in ("hits", "queries"))
    assert page.inner_text("#dash-hit-rate") == f"{100 * hits / queries:.1f} %"
    device = page.locator("#dash-tiers tr[data-tier=device] td").first.inner_text()
    capacity = int(metric(live.url, "kv_tier_capacity_pages"))
    assert device.endswith(f"/ {capacity}")
    preemptions = int(metric(live.url, "num_preemptions_total"))
    assert page.inner_text("#dash-preemptions") == str(preemptions)
    IMAGES.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=IMAGES / "web-desktop.png")

    # a reload keeps the conversation (the browser's storage)
    before = page.locator("#messages li").all_inner_texts()
    page.reload()
    page.wait_for_selector("#model-name:has-text('SmolLM2')")
    assert page.locator("#messages li").all_inner_texts() == before
    page.close()

    for scheme in ("dark",):
        dark = browser.new_page(viewport={"width": 1280, "height": 800}, color_scheme=scheme)
        dark.goto(live.url + "/")
        dark.wait_for_selector("#dash-running:not(:text-is('–'))")
        ask(dark, "Name three colors.")
        time.sleep(1.2)  # a dashboard refresh after the reply
        dark.screenshot(path=IMAGES / f"web-desktop-{scheme}.png")
        dark.close()

    phone = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True)
    phone.goto(live.url + "/")
    phone.wait_for_selector("#dash-running:not(:text-is('–'))")
    settings(phone)
    ask(phone, "What is the capital of France?")
    phone.screenshot(path=IMAGES / "web-phone-chat.png")
    phone.locator("#dashboard").scroll_into_view_if_needed()
    phone.locator("#dashboard").screenshot(path=IMAGES / "web-phone-dashboard.png")
    phone.close()


def test_with_an_api_key_the_page_asks_for_it_and_loads_nothing_without(browser, tiny_model):
    with tiny_llm(tiny_model("llama-gqa4-tied")) as llm, serving(llm, api_key="sekrit") as live:
        assert httpx.get(live.url + "/").status_code == 200  # the page: no data in it
        assert httpx.get(live.url + "/stats").status_code == 401
        page = browser.new_page()
        page.goto(live.url + "/")
        page.wait_for_selector("#key-panel:not([hidden])")
        time.sleep(1.5)  # a poll or two: refused, nothing shown
        assert page.inner_text("#dash-running") == "–" and page.inner_text("#model-name") == ""
        page.fill("#api-key", "wrong")
        page.click("#key-form button")
        page.wait_for_selector("#key-error:has-text('refused')")
        page.fill("#api-key", "sekrit")
        page.click("#key-form button")
        page.wait_for_selector("#model-name:has-text('tiny')")
        page.wait_for_selector("#dash-running:text-is('0')")
        # replies are Markdown, escaped first: a model's text never becomes markup
        html = page.evaluate(
            "markdown('<img src=x onerror=alert(1)> **b** `c<d>`\\n- one\\n```py\\nx<y\\n```')"
        )
        assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
        assert "<strong>b</strong>" in html and "<code>c&lt;d&gt;</code>" in html
        assert "<ul><li>one</li></ul>" in html and "<pre><code>x&lt;y</code></pre>" in html
        page.close()


def test_no_web_ui_leaves_the_page_out(tiny_model):
    with tiny_llm(tiny_model("llama-gqa4-tied")) as llm, serving(llm, web_ui=False) as live:
        assert httpx.get(live.url + "/").status_code == 404
        assert httpx.get(live.url + "/web/app.js").status_code == 404
        assert httpx.get(live.url + "/stats").json()["metrics"]["num_requests_running"] == 0


def test_conversations_regenerate_copy_numbered_lists_chart_axes_and_favicon(browser, tiny_model):
    """Issue 45's page items on a tiny model: a list of conversations (switch, reload, delete),
    Regenerate asks the last question again, Copy puts the reply's text on the clipboard,
    numbered lists keep their numbers, the chart has labelled axes, /favicon.ico is served."""
    with tiny_llm(tiny_model("llama-gqa4-tied")) as llm, serving(llm) as live:
        icon = httpx.get(live.url + "/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
        assert icon.text.startswith("<svg")
        context = browser.new_context()
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=live.url)
        page = context.new_page()
        page.goto(live.url + "/")
        page.wait_for_selector("#model-name:has-text('tiny')")
        settings(page, max_tokens=6)

        # numbered lists: blank lines between items keep one list; a list keeps its numbers
        html = page.evaluate("markdown('1. one\\n\\n2. two\\n\\n3. three')")
        assert html == "<ol><li>one</li><li>two</li><li>three</li></ol>"
        assert page.evaluate("markdown('3. c\\n4. d')").startswith('<ol start="3"><li>c</li>')
        assert page.evaluate("markdown('- a\\n\\ntext')") == "<ul><li>a</li></ul><p>text</p>"

        # two conversations, listed by their first question; each keeps its own messages
        ask(page, "first question")
        page.click("#new-chat")
        ask(page, "second question")
        titles = page.locator("#conversations .open").all_inner_texts()
        assert titles == ["second question", "first question"]
        page.click("#conversations li:nth-child(2) .open")
        assert page.locator("#messages li.user").all_inner_texts() == ["first question"]
        page.reload()
        page.wait_for_selector("#model-name:has-text('tiny')")
        assert page.locator("#conversations .open").all_inner_texts() == titles
        assert page.locator("#messages li.user").all_inner_texts() == ["first question"]

        # Copy: the reply's own text; Regenerate: the last question asked once more
        reply = page.evaluate("messages.at(-1).content")
        page.click("#messages li.assistant [data-action=copy]")
        page.wait_for_function(
            "async (want) => (await navigator.clipboard.readText()) === want", arg=reply
        )
        before = finished(live.url)
        page.click("#messages li.assistant [data-action=regenerate]")
        page.wait_for_selector("#send:not([disabled])")
        assert page.locator("#messages li.user").all_inner_texts() == ["first question"]
        assert page.locator("#messages li.assistant").count() == 1
        assert finished(live.url) == before + 1

        # delete the open conversation: the other one opens
        page.click("#conversations li[aria-current] [data-action=delete]")
        assert page.locator("#conversations .open").all_inner_texts() == ["second question"]
        assert page.locator("#messages li.user").all_inner_texts() == ["second question"]

        # the chart's axes, in the page's words: both scales and the time span
        page.wait_for_selector("#chart-axes:has-text('tok/s 0–')")
        axes = page.inner_text("#chart-axes")
        assert re.fullmatch(r"tok/s 0–\d+ · TTFT 0–\d+ ms · last 120 s", axes), axes
        context.close()

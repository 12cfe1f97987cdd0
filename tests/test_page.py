"""The chat page serve.py shows at / (gptkit/serving/page.html), in a real browser: Debian's headless Chromium
driven by selenium through Debian's chromedriver (.ci/run installs both; the browser tests skip, saying why,
where they are missing). serve.py runs in a subprocess with a model whose replies are known: it answers every
message with "<script>" over and over, so a reply is as long as max tokens lets it be, and would be a script
if the page ever put the model's words in as HTML."""

import http.server
import json
import re
import shutil
import threading

import httpx
import pytest
import torch
from test_serve import CHARS, WAIT, Server, save

from gptkit.chat import prompt_ids
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer
from model import GPT, GPTConfig

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
WORD = "<script>"  # the model's reply, again and again
BLOCK = 4096  # a reply without a token limit takes seconds: long enough to be stopped halfway
SMALL = 64  # the second server's context: a few turns fill it
KEY = "sk-page-7c2d"  # the second server's API key


def script_model(block: int = BLOCK) -> tuple[GPT, Tokenizer]:
    """A chat model (characters and the chat tokens) whose next token depends on the last one only, as a
    lookup: <|assistant|> -> "<", and each character of WORD -> the next one, ">" -> "<" again. Every block
    adds zero (its output projections are zero) and there is no position table, so the final LayerNorm sees the
    last token's one-hot embedding; the untied head gives its successor a logit ~100 above every other token:
    the reply is the same at any temperature."""
    tokenizer = Tokenizer({"kind": "char", "chars": CHARS}).with_special(CHAT_SPECIALS)
    vocab = tokenizer.vocab_size
    config = GPTConfig(block_size=block, vocab_size=vocab, n_layer=1, n_head=1, n_embd=128,
                       tie_embeddings=False)
    model = GPT(config).eval()
    state = {name: torch.ones_like(p) if re.search(r"ln_\w+\.weight$", name) else torch.zeros_like(p)
             for name, p in model.state_dict().items()}
    state["transformer.wte.weight"] = torch.eye(vocab, config.n_embd)
    chain = [tokenizer.special["<|assistant|>"], *tokenizer.encode(WORD), tokenizer.encode(WORD[0])[0]]
    for last, successor in zip(chain, chain[1:]):
        state["lm_head.weight"][successor, last] = 10.0
    model.load_state_dict(state)
    return model, tokenizer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save(tmp_path_factory.mktemp("page") / "out-script", *script_model())
    # The model as loaded (no packed CPU kernels to build first): the page is under test here, not the decoding.
    started = Server(folder, "--max_batch=2", "--max_queue=2", "--quantize=none")
    try:
        yield started.ready()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The same model with a 64-token context, behind an API key."""
    folder = save(tmp_path_factory.mktemp("page") / "out-small", *script_model(SMALL))
    started = Server(folder, "--max_batch=2", "--max_queue=2", "--quantize=none", f"--api_key={KEY}", key=KEY)
    try:
        yield started.ready()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no browser: the test drives Debian's Chromium (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser driver: pip install -e \".[dev]\"")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tmp_path_factory.mktemp("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", f"--user-data-dir={profile}", "--window-size=1000,800",
                 "--host-resolver-rules=MAP rebound.test 127.0.0.1"):  # a name rebound to this machine
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: errors, CSP violations
    # A driver path given: selenium runs it, and never its manager (which would download one).
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_script_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT, poll_frequency=0.02).until(lambda d: condition(), what)


class Page:
    """The chat page open in the browser (with the API key in its tab's storage, when given), with every chat
    request body it sends recorded (window.sent)."""

    def __init__(self, driver, url: str, key: str | None = None):
        from selenium.webdriver.common.by import By

        self.driver, self.by = driver, By
        driver.get_log("browser")  # what earlier pages logged is theirs
        driver.get(url + "/")
        driver.execute_script("sessionStorage.clear()" if key is None else f"sessionStorage.setItem('gptkit-api-key', "
                                                                         f"{json.dumps(key)})")
        driver.refresh()
        driver.execute_script("""
            window.sent = [];
            const send = window.fetch;
            window.fetch = (url, options) => {
              if (String(url).endsWith("/chat/completions")) window.sent.push(JSON.parse(options.body));
              return send(url, options);
            };""")

    def find(self, css: str):
        return self.driver.find_element(self.by.CSS_SELECTOR, css)

    def wait(self, condition, what: str):
        return wait_for(self.driver, condition, what)

    def set_max_tokens(self, value: str) -> None:
        box = self.find("#max-tokens")
        box.clear()
        box.send_keys(value)

    def send(self, text: str) -> None:
        self.find("#prompt").send_keys(text)
        self.find("#send").click()

    def messages(self) -> list[dict]:
        """The transcript: each message's role, text, state and line of figures, as the page shows them."""
        return self.driver.execute_script("""
            return [...document.querySelectorAll('#transcript .message')].map((m) => ({
              role: m.classList.contains('user') ? 'user' : 'assistant', text: m.querySelector('.text').textContent,
              state: m.dataset.state || null, meta: m.querySelector('.meta').textContent,
              elements: m.querySelector('.text').querySelectorAll('*').length}));""")

    def notes(self) -> list[str]:
        return self.driver.execute_script(
            "return [...document.querySelectorAll('#transcript .note')].map((n) => n.textContent)")

    def last_reply_ends(self) -> dict:
        self.wait(lambda: self.messages()[-1]["state"] != "streaming", "the reply to end")
        return self.messages()[-1]

    def console_errors(self) -> list[str]:
        return [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_page_is_one_file_that_loads_nothing_from_elsewhere(server):
    r = httpx.get(server.url + "/", timeout=WAIT)
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]*)""", r.text) == ["data:,"]  # the empty icon
    assert "@import" not in r.text and "url(" not in r.text
    policy = r.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert re.search(r"script-src 'sha256-[\w+/=]+';", policy)  # the page's own script, and no other
    assert "to chat in a browser, open " + server.url + "/" in "".join(server.stderr)


def test_a_conversation_in_the_browser(server, browser):
    page = Page(browser, server.url)
    page.wait(lambda: page.find("#model").text == server.model, "the model's name")
    page.set_max_tokens("8")
    page.find("#prompt").send_keys("Hello")
    page.find("#prompt").send_keys("\n")  # Enter sends
    first = page.last_reply_ends()
    # The reply is the model's text, shown as text: "<script>", with no element made of it.
    assert (first["text"], first["state"], first["elements"]) == (WORD, "done", 0)
    assert browser.execute_script("return document.scripts.length") == 1  # the page's own
    assert re.fullmatch(r"8 tokens · [\d.]+ tokens/s · first token after \d+ ms · cut at the token limit",
                        first["meta"]), first["meta"]
    page.set_max_tokens("16")
    page.send("And again?")
    second = page.last_reply_ends()
    assert (second["text"], second["state"]) == (WORD * 2, "done")
    # The second request carried the conversation: the first message, its reply and the new message.
    sent = browser.execute_script("return window.sent")
    assert [b["messages"] for b in sent] == [
        [{"role": "user", "content": "Hello"}],
        [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": WORD},
         {"role": "user", "content": "And again?"}],
    ]
    assert [(b["model"], b["max_tokens"], b["stream"]) for b in sent] == [(server.model, 8, True),
                                                                            (server.model, 16, True)]
    assert all(b["temperature"] == 0.7 for b in sent)  # the slider's default
    assert [(m["role"], m["text"]) for m in page.messages()] == [
        ("user", "Hello"), ("assistant", WORD), ("user", "And again?"), ("assistant", WORD * 2)]
    assert page.console_errors() == []


def test_stop_cancels_the_reply_halfway(server, browser):
    page = Page(browser, server.url)
    before = server.health()["generated_tokens"]
    page.send("Go on for ever")  # no token limit: the rest of the context, ~4,000 tokens (seconds)
    page.wait(lambda: len(page.messages()[-1]["text"]) >= 40, "the reply to stream")
    page.find("#stop").click()
    reply = page.last_reply_ends()
    assert reply["state"] == "stopped" and reply["meta"].startswith("stopped · ")
    text = reply["text"]
    assert 40 <= len(text) < BLOCK - 100 and (WORD * BLOCK).startswith(text)  # a part of the whole reply
    # The server saw the connection close and cancelled the request: its row is free long before the
    # ~4,000 tokens a whole reply has.
    assert server.wait_until_idle()["generated_tokens"] - before < BLOCK // 2
    # The partial reply stays in the conversation, and the next message carries it.
    page.set_max_tokens("8")
    page.send("Shorter, please")
    assert page.last_reply_ends()["text"] == WORD
    assert browser.execute_script("return window.sent")[-1]["messages"][1] == {"role": "assistant",
                                                                               "content": text}
    assert page.console_errors() == []


def unsent(page: Page, text: str) -> str:
    """The transcript's last message: the user's `text`, marked not sent; the reason shown under it."""
    page.wait(lambda: page.find("#status").text, "the error")
    message = page.messages()[-1]
    assert (message["role"], message["text"], message["state"]) == ("user", text, "error")
    assert message["meta"] == "Not sent: " + page.find("#status").text
    assert page.find("#prompt").get_property("value") == text  # back in the box, to edit or send again
    assert page.find("#send").is_enabled() and not page.find("#stop").is_enabled()
    return message["meta"]


def test_a_refused_request_shows_the_servers_error_and_gives_the_message_back(server, browser):
    page = Page(browser, server.url)
    page.set_max_tokens("100000")  # more than the context
    page.send("Too much")
    assert "max_tokens is 100000" in unsent(page, "Too much")
    assert len(page.messages()) == 1  # no reply
    assert json.dumps(browser.execute_script("return window.sent")).count("Too much") == 1


def test_the_server_not_reachable_is_said_in_words(server, browser):
    page = Page(browser, server.url)
    page.wait(lambda: page.find("#model").text == server.model, "the model's name")
    browser.set_network_conditions(offline=True, latency=0, download_throughput=-1, upload_throughput=-1)
    try:
        page.send("Anyone there?")
        page.wait(lambda: page.find("#status").text, "the error")
    finally:
        browser.delete_network_conditions()
    assert unsent(page, "Anyone there?") == "Not sent: the server is not reachable: is serve.py still running?"


class OtherSite:
    """A web page on another 127.0.0.1 port (another origin) that tries the server three ways: a "simple"
    text/plain POST (no preflight: a browser sends it anywhere), a JSON POST (preflighted) and a GET; it
    records in window.results what it could read."""

    def __init__(self, target: str):
        html = PROBE.replace("TARGET", json.dumps(target)).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(html)))
                self.end_headers()
                self.wfile.write(html)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


PROBE = """<!doctype html><title>another site</title><script>
const target = TARGET, body = JSON.stringify({prompt: "Hello", max_tokens: 5});
window.results = {};
async function attempt(name, request) {
  try {
    const response = await request();
    window.results[name] = {status: response.status, type: response.type, text: await response.text()};
  } catch (e) {
    window.results[name] = {error: e.name};
  }
}
(async () => {
  await attempt("simple", () => fetch(target + "/v1/completions", {method: "POST", mode: "no-cors",
                                      headers: {"Content-Type": "text/plain"}, body}));
  await attempt("json", () => fetch(target + "/v1/completions", {method: "POST",
                                    headers: {"Content-Type": "application/json"}, body}));
  await attempt("chat", () => fetch(target + "/v1/chat/completions", {method: "POST", mode: "no-cors",
      headers: {"Content-Type": "text/plain"}, body: JSON.stringify({messages: [{role: "user", content: "Hi"}]})}));
  await attempt("models", () => fetch(target + "/v1/models"));
  window.done = true;
})();
</script>"""


def test_a_page_from_another_origin_can_neither_get_a_completion_nor_read_one(server, browser):
    before = server.health()
    site = OtherSite(server.url)
    try:
        browser.get(site.url)
        wait_for(browser, lambda: browser.execute_script("return window.done === true"), "the other site's attempts")
        results = browser.execute_script("return window.results")
    finally:
        site.close()
    # The simple POSTs reached the server and were refused before any decoding; the page reads nothing.
    assert results["simple"] == results["chat"] == {"status": 0, "type": "opaque", "text": ""}
    assert results["json"] == results["models"] == {"error": "TypeError"}  # no CORS consent: nothing to read
    after = server.health()
    assert (after["replies"], after["generated_tokens"]) == (before["replies"], before["generated_tokens"])


def test_a_host_name_rebound_to_this_machine_gets_nothing(server, browser):
    """DNS rebinding: rebound.test resolves to 127.0.0.1 (the browser's resolver rule), so a page there would be
    same-origin with the server; the server refuses its Host."""
    port = server.url.rsplit(":", 1)[1]
    browser.get(f"http://rebound.test:{port}/")
    text = browser.find_element("tag name", "body").text
    assert "host_not_allowed" in text and "<textarea" not in browser.page_source


def test_the_page_asks_for_the_api_key_and_chats_with_it(small, browser):
    page = Page(browser, small.url)
    page.wait(lambda: page.find("#key-form").is_displayed(), "the key form")
    assert "needs its API key" in page.find("#status").text and page.find("#model").text == "no model"
    assert KEY not in httpx.get(small.url + "/", timeout=WAIT).text  # the page itself never holds the key
    page.find("#api-key").send_keys("wrong")
    page.find("#use-key").click()
    page.wait(lambda: "not this server's" in page.find("#status").text, "the wrong key refused")
    page.find("#api-key").send_keys(KEY + "\n")
    page.wait(lambda: page.find("#model").text == small.model, "the model's name")
    assert not page.find("#key-form").is_displayed()
    page.set_max_tokens("8")
    page.send("Hello")
    reply = page.last_reply_ends()
    assert (reply["text"], reply["state"]) == (WORD, "done")
    assert browser.execute_script("return sessionStorage.getItem('gptkit-api-key')") == KEY
    errors = page.console_errors()
    assert all("401" in e for e in errors), errors  # the refused tries, and nothing else


def test_a_conversation_longer_than_the_context(small, browser):
    """64 tokens of context, replies of 8: from the fourth message on the oldest messages are dropped (the
    system message stays), the page says so, and every reply is still whole."""
    tokenizer = script_model(SMALL)[1]
    page = Page(browser, small.url, key=KEY)
    page.wait(lambda: page.find("#model").text == small.model, "the model's name")
    page.find("details.system summary").click()
    page.find("#system").send_keys("Be brief.")
    page.set_max_tokens("8")
    for i in range(6):
        page.send(f"Hello {i}")
        assert page.last_reply_ends()["text"] == WORD
    sent = [b["messages"] for b in browser.execute_script("return window.sent")]
    whole = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        whole.append({"role": "user", "content": f"Hello {i}"})
        assert sent[i][0] == whole[0] and sent[i][1:] == whole[len(whole) - len(sent[i]) + 1:]  # the latest ones
        assert len(prompt_ids(sent[i], tokenizer)) <= SMALL - 8  # room for the reply
        whole.append({"role": "assistant", "content": WORD})
    assert len(sent[0]) == 2 and len(sent[-1]) < 12  # the first went whole, the last without the oldest
    # a request that dropped messages dropped down to half the prompt's room: the next ones reuse its history
    cut = [i for i in range(1, 6) if len(sent[i]) < len(sent[i - 1]) + 2]
    assert cut and all(len(prompt_ids(sent[i], tokenizer)) <= (SMALL - 8) // 2 for i in cut)
    notes = page.notes()
    assert notes and all("no longer fit" in n and f"({SMALL} tokens)" in n for n in notes)
    dropped = browser.execute_script("return document.querySelectorAll('#transcript .message.dropped').length")
    assert dropped == 11 - (len(sent[-1]) - 1)  # the messages the last request left out, dimmed
    assert all(m["state"] == "done" for m in page.messages() if m["role"] == "assistant")


def test_a_token_limit_or_a_system_message_too_long_for_the_context_is_said_in_the_transcript(small, browser):
    """64 tokens of context: a token limit of 2000 leaves no room beside any prompt, and a system message of
    80 characters is longer than the context. Each send is refused, the message stays in the transcript
    marked as not sent with the server's sentence under it, and is not part of the conversation: the next
    send, with a limit that fits, carries only itself."""
    page = Page(browser, small.url, key=KEY)
    page.wait(lambda: page.find("#model").text == small.model, "the model's name")
    page.set_max_tokens("2000")
    page.send("Hello")
    assert unsent(page, "Hello") == ("Not sent: max_tokens is 2000, but the prompt has 9 tokens and the "
                                     "model's context is 64: a reply can have at most 55")
    page.find("#prompt").clear()
    page.find("details.system summary").click()
    page.find("#system").send_keys("x" * 80)
    page.set_max_tokens("")
    page.send("Hi")
    assert unsent(page, "Hi") == ("Not sent: the prompt has 88 tokens, but the model's context is 64 tokens, and "
                                  "a prompt may have at most 63 of them, to leave room for a reply")
    page.find("#prompt").clear()
    page.find("#system").clear()
    page.set_max_tokens("8")
    page.send("Hi")
    assert page.last_reply_ends()["text"] == WORD
    assert browser.execute_script("return window.sent")[-1]["messages"] == [{"role": "user", "content": "Hi"}]
    assert [m["state"] for m in page.messages()] == ["error", "error", None, "done"]


def test_a_reply_that_fills_the_context_says_so(small, browser):
    page = Page(browser, small.url, key=KEY)
    page.wait(lambda: page.find("#model").text == small.model, "the model's name")
    page.send("Hi")  # no token limit: the reply runs to the end of the context
    first = page.last_reply_ends()
    assert first["state"] == "done" and len(first["text"]) > SMALL // 2
    assert first["meta"].endswith(" · the context filled up"), first["meta"]
    page.send("More")  # the long reply no longer fits with room for another: it is dropped, and said
    assert page.last_reply_ends()["state"] == "done"
    assert page.notes() and "no longer fit" in page.notes()[0]

"""The chat page serve.py shows at / (gptkit/serving/page.html), in a real browser: Debian's headless Chromium
driven by selenium through Debian's chromedriver (.ci/run installs both; the browser tests skip, saying why,
where they are missing). serve.py runs in a subprocess with a model whose replies are known: it answers every
message with "<script>" over and over, so a reply is as long as max tokens lets it be, and would be a script
if the page ever put the model's words in as HTML."""

import json
import re
import shutil

import httpx
import pytest
import torch
from test_serve import CHARS, WAIT, Server, save

from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer
from model import GPT, GPTConfig

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
WORD = "<script>"  # the model's reply, again and again
BLOCK = 4096  # a reply without a token limit takes seconds: long enough to be stopped halfway


def script_model() -> tuple[GPT, Tokenizer]:
    """A chat model (characters and the chat tokens) whose next token depends on the last one only, as a
    lookup: <|assistant|> -> "<", and each character of WORD -> the next one, ">" -> "<" again. Every block
    adds zero (its output projections are zero) and there is no position table, so the final LayerNorm sees the
    last token's one-hot embedding; the untied head gives its successor a logit ~100 above every other token:
    the reply is the same at any temperature."""
    tokenizer = Tokenizer({"kind": "char", "chars": CHARS}).with_special(CHAT_SPECIALS)
    vocab = tokenizer.vocab_size
    config = GPTConfig(block_size=BLOCK, vocab_size=vocab, n_layer=1, n_head=1, n_embd=128,
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
def browser(tmp_path_factory):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no browser: the test drives Debian's Chromium (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser driver: pip install -e \".[dev]\"")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tmp_path_factory.mktemp("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", f"--user-data-dir={profile}", "--window-size=1000,800"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: errors, CSP violations
    # A driver path given: selenium runs it, and never its manager (which would download one).
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_script_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The chat page open in the browser, with every request body it sends recorded (window.sent)."""

    def __init__(self, driver, url: str):
        from selenium.webdriver.common.by import By

        self.driver, self.by = driver, By
        driver.get(url + "/")
        driver.execute_script("""
            window.sent = [];
            const send = window.fetch;
            window.fetch = (url, options) => {
              if (options && options.body) window.sent.push(JSON.parse(options.body));
              return send(url, options);
            };""")

    def find(self, css: str):
        return self.driver.find_element(self.by.CSS_SELECTOR, css)

    def wait(self, condition, what: str):
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, WAIT, poll_frequency=0.02).until(lambda d: condition(), what)

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


def test_a_refused_request_shows_the_servers_error_and_gives_the_message_back(server, browser):
    page = Page(browser, server.url)
    page.set_max_tokens("100000")  # more than the context
    page.send("Too much")
    page.wait(lambda: page.find("#status").text, "the error")
    assert "max_tokens is 100000" in page.find("#status").text
    assert page.messages() == [] and page.find("#prompt").get_property("value") == "Too much"
    assert page.find("#send").is_enabled() and not page.find("#stop").is_enabled()
    assert json.dumps(browser.execute_script("return window.sent")).count("Too much") == 1

"""Security: who may call what, how much a request may carry, what is never executed or
unpickled, and prefix-cache isolation between tenants."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from live_server import serving, tiny_llm
from patience import patience

from pypto_serving.cli import build_parser
from pypto_serving.config import ServerConfig
from pypto_serving.errors import PyptoError

MODEL = "llama-gqa4-tied"
KEY = "sekret-key"


def test_the_default_bind_is_loopback():
    assert ServerConfig().host == "127.0.0.1"
    assert build_parser().parse_args(["serve"]).host is None  # unset: the config's default


def test_the_api_key_guards_every_route_but_health_and_the_pages_files(tiny_model):
    """/health is open for probes; the web page's own files hold no data and load without the
    key (the page then asks for it); everything else needs it, unknown paths included."""
    llm = tiny_llm(tiny_model(MODEL))
    with serving(llm, api_key=KEY) as live:
        app_routes = {
            (method, route.path)
            for route in live.app.routes
            for method in getattr(route, "methods", None) or ()
            if method != "HEAD"
        }
        assert {("GET", "/openapi.json"), ("GET", "/metrics"), ("GET", "/version")} <= app_routes
        page = {("GET", "/web/app.js"), ("GET", "/web/style.css"), ("GET", "/web/index.html")}
        routes = sorted(app_routes | page | {("GET", "/no/such/route"), ("DELETE", "/v1/models")})
        bodies = {"/tokenize": {"prompt": "x"}, "/detokenize": {"tokens": [5]}}
        bodies |= {"/v1/completions": {"prompt": "x", "max_tokens": 2}}
        bodies |= {"/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]}}
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = httpx.request(
                    method,
                    live.url + path,
                    json=bodies.get(path),
                    headers=headers,
                    timeout=patience(30),
                )
                if path in ("/health", "/", "/web/app.js", "/web/style.css", "/favicon.ico"):
                    assert r.status_code == 200
                    continue
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.json()["error"]["code"] == "invalid_api_key"
            good = {"Authorization": f"Bearer {KEY}"}
            r = httpx.request(method, live.url + path, json=bodies.get(path), headers=good)
            assert r.status_code != 401, (method, path)
        # a refused client cannot make the server read a large body first
        r = httpx.post(live.url + "/v1/completions", content=b"x" * (3 << 20))
        assert r.status_code == 401


def test_request_headers_over_the_limit_get_431(tiny_model):
    llm = tiny_llm(tiny_model(MODEL))
    with serving(llm, max_header_bytes=4096) as live:
        r = httpx.get(live.url + "/v1/models", headers={"X-Padding": "a" * 5000})
        assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
        assert httpx.get(live.url + "/v1/models", headers={"X-Padding": "a" * 1000}).is_success


def test_cache_salt_isolates_the_prefix_cache(tiny_model):
    llm = tiny_llm(tiny_model(MODEL))
    prompt = [(5 * j) % 250 + 3 for j in range(70)]  # four full pages of 16

    def cached(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=patience(30))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with serving(llm) as live:
        assert cached("tenant-a") == 0
        assert cached("tenant-a") == 64  # the same tenant hits its own pages
        assert cached("tenant-b") == 0  # another tenant does not
        assert cached(None) == 0  # nor does a request without a salt
        assert cached(None) == 64
        for bad in ("", "x" * 257, 5):
            body = {"prompt": prompt, "max_tokens": 1, "cache_salt": bad}
            r = httpx.post(live.url + "/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_the_model_field_is_a_name_never_a_path(tiny_model):
    llm = tiny_llm(tiny_model(MODEL))
    with serving(llm) as live:
        for name in ("../../../etc/passwd", str(tiny_model(MODEL)), "/dev/zero"):
            body = {"model": name, "prompt": "x", "max_tokens": 1}
            r = httpx.post(live.url + "/v1/completions", json=body)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_model_provided_code_is_never_executed(tiny_model, tmp_path):
    """A checkpoint asking for its own Python code (auto_map, trust_remote_code style) is
    refused or loaded with our own code; its files are never imported."""
    model = Path(shutil.copytree(tiny_model(MODEL), tmp_path / "remote"))
    marker = tmp_path / "executed"
    code = f"open({str(marker)!r}, 'w').write('yes')\n"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py"):
        (model / name).write_text(code)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    (model / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    with contextlib.suppress(PyptoError):  # refusing it is fine too
        tiny_llm(model).close()
    config["architectures"] = ["EvilForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(PyptoError, match="unsupported architecture EvilForCausalLM"):
        tiny_llm(model)
    assert not marker.exists()


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of the TCP sockets `pid` listens on (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state 0A: LISTEN
                found.append(fields[1])
    return found


def test_worker_channels_listen_on_no_network(tiny_model):
    """Replicas talk over inherited socketpairs (they listen on nothing); tensor-parallel
    ranks exchange tensors over gloo on loopback only."""
    with tiny_llm(tiny_model(MODEL), data_parallel_size=2) as llm:
        for replica in llm.engine.replicas:
            assert listening_addresses(replica.pid) == []
    with tiny_llm(tiny_model(MODEL), tensor_parallel_size=2) as llm:
        for pid in [os.getpid(), *(w.pid for w in llm.engine.workers)]:
            for address in listening_addresses(pid):
                host = address.split(":")[0]
                assert host in ("0100007F", "00000000000000000000000001000000"), address

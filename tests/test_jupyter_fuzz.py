"""Hypothesis-built requests against the per-agent Jupyter Server API of a real gateway.

The Jupyter routes are jupyter_server's, not ours to describe in OpenAPI, so
the requests are built here from their shapes: every route template, each
method, path parts that are valid, hostile (``..``, absolute, NUL, 300-byte
names, other agents) or random, query strings and JSON or garbage bodies.
No response may be a 5xx, every error must be JSON with Jupyter's
``message`` beside our ``error`` object, and nothing may be created outside
the agent's tree.  ``KG_FUZZ_EXAMPLES`` sets the number of requests.
"""

from __future__ import annotations

import json
import os
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import GatewayProcess

EXAMPLES = int(os.environ.get("KG_FUZZ_EXAMPLES", "60")) * 8
AGENT = "jfuzz"

TEMPLATES = [
    "api", "api/status", "api/kernelspecs", "api/kernelspecs/{name}", "kernelspecs/{name}/{resource}",
    "api/kernels", "api/kernels/{kid}", "api/kernels/{kid}/interrupt", "api/kernels/{kid}/restart",
    "api/sessions", "api/sessions/{sid}",
    "api/contents/{path}", "api/contents/{path}/checkpoints", "api/contents/{path}/checkpoints/{cid}",
]
HOSTILE = ["..", "../..", "%2e%2e", "/etc/passwd", "a%00b", "x" * 300, "../../other/user-files", "~root",
           "user-files/../../..", "python3", "logo-64x64.png", "notebook.ipynb", "user-files", "",
           "a%0Ab", "%0D%0ALocation:%20x", "tab%09name", "user-files%2Fx%0A"]
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
part = st.one_of(st.sampled_from(HOSTILE), text.map(lambda t: urllib.parse.quote(t, safe="")))
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4), max_leaves=12,
)
model_like = st.fixed_dictionaries({}, optional={
    "name": text, "path": part, "type": st.sampled_from(["notebook", "file", "directory", "x"]) | text,
    "format": st.sampled_from(["text", "base64", "json", None]) | text, "content": json_value,
    "kernel": st.dictionaries(st.sampled_from(["id", "name"]), text | st.none(), max_size=2),
    "copy_from": part, "id": text,
})
# Bodies a parser must refuse before trusting: deep, non-finite, lone surrogates, huge numbers and strings.
hostile_body = st.sampled_from([
    "[" * 5000, '{"a":' * 3000 + "1" + "}" * 3000, '{"path": ' + "[" * 65 + "]" * 65 + "}",
    '{"name": NaN}', '{"copy_from": Infinity}', '{"path": "\\ud800"}', '{"type": "\\udfff"}', "1" * 5000,
    '{"content": "' + "x" * 200_000 + '", "type": "file", "format": "text"}', '{"path": "user-files/a\\nb"}',
])
body = st.one_of(st.none(), model_like.map(json.dumps), json_value.map(json.dumps),
                 st.binary(max_size=64).map(lambda b: b.decode("latin-1")), hostile_body)


@st.composite
def requests(draw):
    template = draw(st.sampled_from(TEMPLATES))
    path = template
    for name in ("name", "resource", "kid", "sid", "cid"):
        path = path.replace("{" + name + "}", draw(part) or "x")
    path = path.replace("{path}", "/".join(draw(st.lists(part, min_size=1, max_size=3))))
    query = draw(st.dictionaries(st.sampled_from(["content", "type", "format", "hash", "token"]), text, max_size=2))
    method = draw(st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE"]))
    return method, path, urllib.parse.urlencode(query), draw(body)


@pytest.fixture(scope="module")
def jupyter_gateway(tmp_path_factory):
    gw = GatewayProcess(tmp_path_factory.mktemp("jfuzz"), "--jupyter-port=0", "--Gateway.spare_kernels=False",
                        "--Gateway.max_sessions_per_agent=3").start()
    assert gw.client.call("PUT", f"/v1/agents/{AGENT}")[0] == 201
    assert gw.client.call("PUT", "/v1/agents/other")[0] == 201
    (open(os.path.join(gw.root, "other", "user-files", "secret.txt"), "w")).write("other's\n")
    yield gw
    gw.stop()


def tree(root: str) -> set[str]:
    return {os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files}


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(request=requests())
def test_no_jupyter_request_gets_a_5xx_or_reaches_outside(jupyter_gateway, request):
    gw = jupyter_gateway
    method, path, query, data = request
    others = tree(os.path.join(gw.root, "other"))
    url = f"/agents/{AGENT}/{path}" + (f"?{query}" if query else "")
    raw = None if data is None else data.encode("utf-8", "surrogateescape")
    if method in ("GET", "DELETE"):
        raw = None
    status, answer = gw.client.call(method, url, raw=raw, headers={"Content-Type": "application/json"})
    assert status < 500, (method, url, data, status, answer)
    if status >= 400:
        # Our error object always; a Jupyter route also puts Jupyter's "message" beside it.
        assert isinstance(answer, dict) and set(answer["error"]) == {"code", "message", "hint"}, (url, answer)
        if answer["error"]["code"] != "no_route":
            assert isinstance(answer.get("message"), str), (method, url, status, answer)
    assert tree(os.path.join(gw.root, "other")) == others  # nothing done to another agent
    assert gw.client.call("GET", "/v1/info")[0] == 200
    # Kernels the fuzz starts are stopped, so the session cap does not hide the routes.
    if path.startswith("api/kernels") and method == "POST" and status == 201:
        gw.client.call("DELETE", f"/agents/{AGENT}/api/kernels/{answer['id']}")


# --- the Library, jobs and tokens: the same base, the same parser --------------------------

V1_TEMPLATES = [
    ("PUT", "skills/{name}"), ("PATCH", "skills/{name}"), ("DELETE", "skills/{name}"), ("GET", "skills/{name}"),
    ("PUT", "documents/{name}"), ("GET", "documents/{name}"), ("POST", "jobs"), ("GET", "jobs/{name}"),
    ("POST", "jobs/{name}/apply"), ("POST", "jobs/{name}/cancel"), ("GET", "jobs/{name}/patch"),
    ("DELETE", "jobs/{name}"), ("POST", "tokens"), ("DELETE", "tokens/{name}"), ("PUT", ""),
]
v1_names = st.sampled_from(["SOUL.md", "MISSION.md", "jupyter-live-kernel", "mine", "0123456789ab", "x" * 300,
                            "a%0Ab", "..", "%2e%2e", "a%00b"]) | text.map(lambda t: urllib.parse.quote(t, safe=""))


@st.composite
def v1_requests(draw):
    method, template = draw(st.sampled_from(V1_TEMPLATES))
    path = template.replace("{name}", draw(v1_names) or "x")
    content_type = draw(st.sampled_from(["application/json", "text/plain", "application/gzip", ""]))
    return method, path, content_type, draw(body), draw(st.booleans())


@settings(max_examples=EXAMPLES // 2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(request=v1_requests())
def test_no_library_job_or_token_request_gets_a_5xx(jupyter_gateway, request):
    gw = jupyter_gateway
    method, path, content_type, data, on_agent_socket = request
    others = tree(os.path.join(gw.root, "other"))
    client = gw.agent_client(AGENT) if on_agent_socket else gw.client
    url = f"/v1/agents/{'me' if on_agent_socket else AGENT}" + (f"/{path}" if path else "")
    raw = None if data is None or method in ("GET", "DELETE") else data.encode("utf-8", "surrogateescape")
    status, answer = client.call(method, url, raw=raw, headers={"Content-Type": content_type} if content_type else {})
    assert status < 500, (method, url, data and data[:200], status, answer)
    if status >= 400:
        assert isinstance(answer, dict) and set(answer["error"]) == {"code", "message", "hint"}, (url, answer)
    assert tree(os.path.join(gw.root, "other")) == others
    assert gw.client.call("GET", "/v1/info")[0] == 200

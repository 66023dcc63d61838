"""The OpenAPI document is served, and it is true to the route table.

The document is hand-written (kernel_gateway/openapi.py); these tests hold it
against the routes the app really serves, in both directions, and check the
document itself and its examples against the OpenAPI 3.1 schema dialect.
The fuzzing of the real gateway through the document is in test_fuzz.py.
"""

from __future__ import annotations

import re

import jsonschema
import pytest
from tornado import web

from kernel_gateway import __version__, openapi
from kernel_gateway.server import app as app_module
from kernel_gateway.server.notebook_routes import NotANotebookHandler

METHODS = ("get", "put", "post", "patch", "delete")
# Routes that exist only to answer an error (no .ipynb in a notebook path).
ERROR_ONLY = {NotANotebookHandler}
SAMPLES = {"token": "0123456789ab", "agent": "alice", "session": "s1", "path": "dir/nb.ipynb", "cell_id": "c1", "name": "x",
           "skill": "my-skill", "document": "SOUL.md", "job": "j1"}


def served_routes() -> list[tuple[re.Pattern, type]]:
    return [
        (re.compile(pattern + "$"), handler)
        for module in app_module.ROUTE_MODULES
        for pattern, handler in module.routes()
    ]


def methods_of(handler: type) -> set[str]:
    return {m for m in METHODS if getattr(handler, m) is not getattr(web.RequestHandler, m)}


def route_for(url: str) -> type | None:
    """The handler Tornado picks for ``url``: the first matching route."""
    for pattern, handler in served_routes():
        if pattern.match(url):
            return handler
    return None


def sample_url(template: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: SAMPLES[m.group(1)], template)


DOC = openapi.document(__version__)


@pytest.mark.parametrize("template", sorted(DOC["paths"]))
def test_every_documented_route_is_served_with_its_methods(template):
    handler = route_for(sample_url(template))
    assert handler is not None, f"{template} is documented but no route serves it"
    assert handler not in ERROR_ONLY, f"{template} reaches an error-only route"
    documented = {m for m in DOC["paths"][template] if m in METHODS}
    assert documented == methods_of(handler), f"{template}: documented {documented}, served {methods_of(handler)}"


def test_every_served_route_is_documented():
    reached = {route_for(sample_url(t)) for t in DOC["paths"]}
    missing = [
        (pattern.pattern, handler.__name__)
        for pattern, handler in served_routes()
        if handler not in reached and handler not in ERROR_ONLY
    ]
    assert missing == [], f"routes missing from the OpenAPI document: {missing}"


def test_every_path_parameter_is_declared():
    for template, item in DOC["paths"].items():
        names = set(re.findall(r"\{(\w+)\}", template))
        declared = {p["name"] for p in item.get("parameters", []) if p["in"] == "path"}
        assert names == declared, template


def test_every_error_response_has_the_error_shape():
    for template, item in DOC["paths"].items():
        for method in METHODS:
            if method not in item:
                continue
            for status, response in item[method]["responses"].items():
                if status.startswith("4"):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema is openapi.ERROR or openapi.ERROR in schema.get("allOf", []), (template, status)


def test_schemas_are_valid_json_schema_2020_12():
    """Each schema in the document is itself a valid JSON Schema (OpenAPI 3.1's dialect)."""
    def schemas(node):
        if isinstance(node, dict):
            if "schema" in node and isinstance(node["schema"], dict):
                yield node["schema"]
            for value in node.values():
                yield from schemas(value)
        elif isinstance(node, list):
            for value in node:
                yield from schemas(value)

    found = list(schemas(DOC))
    assert len(found) > 40
    for schema in found:
        jsonschema.Draft202012Validator.check_schema(schema)


def test_the_command_body_names_every_request_key():
    from kernel_gateway.tools.command import REQUEST_KEYS

    schema = DOC["paths"]["/v1/agents/{agent}/commands"]["post"]["requestBody"]["content"]["application/json"]
    assert set(schema["schema"]["properties"]) == set(REQUEST_KEYS)


EXAMPLES = [
    # (route, method, body that must be valid, body that must not be)
    ("/v1/agents/{agent}/sessions/{session}/execute", "post", {"code": "x = 1", "timeout": 5}, {"code": 7}),
    ("/v1/agents/{agent}/sessions/{session}/execute", "post", {"code": "1", "stream": True}, {"timeout": 1}),
    ("/v1/agents/{agent}/commands", "post", {"command": "ls -la", "env": {"A": "b"}}, {"command": "ls", "x": 1}),
    ("/v1/agents/{agent}/patch", "post", {"patch": "*** Begin Patch\n*** End Patch", "cwd": "."}, {"cwd": "."}),
    ("/v1/agents/{agent}/notebooks/{path}/cells", "post", {"index": 0, "source": "1"}, {"index": "0"}),
    ("/v1/agents/{agent}/sessions", "post", {"session": "main"}, {"session": 3}),
]


@pytest.mark.parametrize("route,method,good,bad", EXAMPLES)
def test_request_examples_match_their_schemas(route, method, good, bad):
    schema = DOC["paths"][route][method]["requestBody"]["content"]["application/json"]["schema"]
    jsonschema.validate(good, schema, cls=jsonschema.Draft202012Validator)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema, cls=jsonschema.Draft202012Validator)


def test_the_document_is_served(gateway_for_openapi):
    status, served = gateway_for_openapi.client.call("GET", "/v1/openapi.json")
    assert status == 200
    assert served == DOC
    assert served["openapi"] == "3.1.0"
    # Readable on an agent's own socket too.
    gateway_for_openapi.client.call("PUT", "/v1/agents/doc")
    status, again = gateway_for_openapi.agent_client("doc").call("GET", "/v1/openapi.json")
    assert (status, again) == (200, DOC)


def test_documented_responses_match_real_ones(gateway_for_openapi):
    """A few real responses of a real gateway validate against their documented schema."""
    client = gateway_for_openapi.client
    checks = [
        ("PUT", "/v1/agents/ex", None, "/v1/agents/{agent}", "put"),
        ("POST", "/v1/agents/ex/sessions", {"session": "s"}, "/v1/agents/{agent}/sessions", "post"),
        ("GET", "/v1/agents/ex/sessions", None, "/v1/agents/{agent}/sessions", "get"),
        ("POST", "/v1/agents/ex/sessions/s/execute", {"code": "print(1)\n2"},
         "/v1/agents/{agent}/sessions/{session}/execute", "post"),
        ("POST", "/v1/agents/ex/sessions/s/execute", {"code": 7},
         "/v1/agents/{agent}/sessions/{session}/execute", "post"),
        ("GET", "/v1/agents/nobody", None, "/v1/agents/{agent}", "get"),
    ]
    for method, url, body, template, op in checks:
        status, payload = client.call(method, url, body)
        responses = DOC["paths"][template][op]["responses"]
        assert str(status) in responses, (url, status)
        schema = responses[str(status)]["content"]["application/json"]["schema"]
        jsonschema.validate(payload, schema, cls=jsonschema.Draft202012Validator)
    client.call("DELETE", "/v1/agents/ex/sessions/s")


@pytest.fixture(scope="module")
def gateway_for_openapi(tmp_path_factory):
    from support import GatewayProcess

    gw = GatewayProcess(tmp_path_factory.mktemp("openapi"), "--Gateway.spare_kernels=False").start()
    yield gw
    gw.stop()


def test_the_whole_document_is_valid_openapi_3_1():
    """Against the official OpenAPI 3.1 meta-schema, not only its JSON Schemas."""
    import json

    from openapi_spec_validator import validate
    from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

    document = json.loads(json.dumps(DOC))  # as it is served: JSON, keys are strings
    validate(document)
    # The validator does see a misplaced field (a media type object has no description).
    broken = json.loads(json.dumps(DOC))
    broken["paths"]["/v1/agents/{agent}/sessions"]["get"]["responses"]["200"]["content"]["application/json"][
        "description"] = "not allowed here"
    with pytest.raises(OpenAPIValidationError):
        validate(broken)

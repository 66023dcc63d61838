"""Source guards: each dangerous thing has one way in the package, and new code cannot take another.

Each guard scans the package's source (its AST, not its text) for the calls
that would bypass the one mechanism, with a short allow-list that says why
each entry may.  Each guard also has a test that feeds it deliberately bad
lines, so a guard that stopped seeing anything would fail too.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "kernel_gateway"


def package_sources() -> dict[str, str]:
    """Every Python file of the package: its path relative to the package, and its text."""
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def call_name(node: ast.Call) -> str:
    """The called name: ``f`` for ``f()`` and ``x.f()``; '' for anything else (``f()()``)."""
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def scopes(tree: ast.AST):
    """(node, qualified name of the function or class around it) for every node of ``tree``."""
    todo = [(tree, "")]
    while todo:
        node, where = todo.pop()
        yield node, where
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{where}.{child.name}" if where else child.name
            todo.append((child, inner))


# --- no listener outside the accept gate -------------------------------------------

GATE = "server/connections.py"
# Calls that make or serve a listening socket; every one belongs in the gate.
LISTENER_CALLS = {
    "bind_sockets", "bind_unix_socket", "add_sockets", "add_socket", "listen", "bind",
    "start_server", "start_unix_server", "create_server", "create_unix_server",
    "HTTPServer", "TCPServer",
}
LISTENER_CLASSES = {"HTTPServer", "TCPServer"}
LISTENER_ALLOWED = {
    # `kernel-gateway lab` is its own process, not the gateway: it relays one person's browser on a
    # loopback port to JupyterLab's socket in the agent's sandbox (JupyterLab checks the pairing
    # token).  A flood there costs that relay's descriptors, never the gateway's.
    ("lab/command.py", "listen"),
    ("lab/command.py", "run"),  # its call of that listen()
    ("lab/forwarder.py", "Forwarder.start"),
}


def listener_violations(sources: dict[str, str]) -> list[str]:
    found = []
    for path, text in sources.items():
        if path == GATE:
            continue
        for node, where in scopes(ast.parse(text, path)):
            what = None
            if isinstance(node, ast.Call) and call_name(node) in LISTENER_CALLS:
                what = f"{call_name(node)}()"
            elif isinstance(node, ast.ClassDef):
                bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                if bases & LISTENER_CLASSES:
                    what = f"a subclass of {', '.join(sorted(bases & LISTENER_CLASSES))}"
            if what and (path, where) not in LISTENER_ALLOWED:
                found.append(f"{path}:{node.lineno} in {where or '<module>'}: {what}")
    return found


def test_no_listener_is_created_or_served_outside_the_gate():
    found = listener_violations(package_sources())
    assert not found, (
        "listening sockets are bound and served by server/connections.py (ConnectionGate) only, so that "
        "every listener has its caps, its token check and its backlog:\n" + "\n".join(found)
    )


def test_the_listener_guard_sees_each_way_to_listen():
    bad = {
        "a.py": "from tornado import netutil\nsockets = netutil.bind_sockets(0, '127.0.0.1')\n",
        "b.py": "def serve(s, app):\n    s.add_sockets(app)\n",
        "c.py": "import socket\ndef f():\n    socket.socket().bind(('127.0.0.1', 0))\n",
        "d.py": "from tornado import httpserver\nserver = httpserver.HTTPServer(None)\n",
        "e.py": "import asyncio\nasync def f(h):\n    await asyncio.start_unix_server(h, path='/x')\n",
        "f.py": "def f(app):\n    app.listen(8888)\n",
        "g.py": "from tornado.httpserver import HTTPServer\nclass Mine(HTTPServer):\n    pass\n",
        "lab/command.py": "def elsewhere(s):\n    s.listen(5)\n",  # allowed only in its own function
    }
    found = listener_violations(bad)
    assert [f.split(":")[0] for f in found] == sorted(bad), found
    assert not listener_violations({GATE: bad["a.py"], "lab/command.py": "def listen(s):\n    s.listen(5)\n"})

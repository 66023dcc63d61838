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


# --- the confined filesystem layer -------------------------------------------------------
#
# Every host-side open, create, list, rename, chown and remove in an agent's tree goes through
# kernel_gateway/fs.  Outside it, no call may name a path to the kernel: builtin open(), os.<path
# functions>, os.path queries that touch the disk, shutil, glob, pathlib's file methods.  Calls on
# fds (os.fstat, os.read, os.close, os.fdopen) are fine: the fd came from the layer.

FS_LAYER = "fs/"
OS_PATH_CALLS = {
    "open", "stat", "lstat", "listdir", "scandir", "mkdir", "makedirs", "rename", "renames", "replace",
    "remove", "unlink", "rmdir", "removedirs", "chmod", "lchmod", "chown", "lchown", "symlink", "readlink",
    "walk", "fwalk", "link", "mkfifo", "mknod", "truncate", "utime", "access", "chdir", "chroot", "statvfs",
    "getxattr", "setxattr", "listxattr", "removexattr",
}
OS_PATH_QUERIES = {"exists", "lexists", "isdir", "isfile", "islink", "ismount", "realpath", "getsize",
                   "getmtime", "getatime", "getctime", "samefile"}
PATHLIB_ONLY = {"read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "rglob", "symlink_to",
                "hardlink_to", "is_fifo", "is_socket", "is_block_device", "is_char_device"}
PATHLIB_PURE = {"joinpath", "with_name", "with_suffix", "with_stem", "relative_to", "is_relative_to", "as_posix",
                "match", "is_absolute"}  # string work, no disk

# Modules whose every path is the gateway's or the operator's, never an agent's tree.
FS_MODULES_ALLOWED = {
    "sandbox/": "cgroups, /proc, the bind aliases, disk images, the profiles: the gateway's own paths",
    "state_files.py": "the state directory's JSON writer",
    "server/app.py": "the state, runtime and socket directories at start and stop",
    "server/connections.py": "the gate's spare descriptor on /dev/null",
    "kernel_pool.py": "the kernels' runtime directories",
    "kernels.py": "kernelspecs, kernel logs and runtime files in the state directory",
    "kernel_output.py": "the kernel log in the state directory",
    "provisioner.py": "the Python environment and the runtime directory handed to the kernel",
    "kernel_ext.py": "runs inside the kernel's sandbox, as the agent, not on the host",
    "doctor.py": "the operator's checks, in a scratch directory of its own",
    "cli.py": "the operator's command line: kernelspec install, settings files",
    "audit.py": "the audit log in the state directory",
    "jupyter_api/tokens.py": "the token store in the state directory",
    "jupyter_api/kernelspecs.py": "the package's own kernelspec resources",
    "codex_runner.py": "finding the operator's codex binary",
    "command_spares.py": "finding the package's exec stub",
    "lab/": "JupyterLab's runtime directory; the tree owner and the relay socket are opened O_NOFOLLOW "
            "and checked by fd (see lab/forwarder.py)",
}

# Single functions, in modules that otherwise touch agent trees only through the layer.
FS_FUNCTIONS_ALLOWED = {
    ("agent_uids.py", "AgentUids.__init__"): "the uid map in the state directory",
    ("agent_uids.py", "AgentUids.run_as"): "<root>/<agent> itself, the gateway's directory",
    ("agents.py", "AgentRegistry.load"): "<root>/<agent> itself, the gateway's directory",
    ("workspace.py", "create_agent_tree"): "<root>/<agent> itself, the gateway's directory",
    ("jobs.py", "JobStore.save"): "job records in the state directory",
    ("jobs.py", "JobStore.remove"): "job records in the state directory",
    ("jobs.py", "JobStore.load_all"): "job records in the state directory",
    ("jobs.py", "_source"): "realpath of the agent root itself, the gateway's path",
    ("job_runner.py", "job_dir"): "realpath of the agent root itself, the gateway's path",
    ("job_runner.py", "copy_in"): "realpath of the agent root itself, the gateway's path",
    ("sessions.py", "Sessions.load_registry"): "the session registry in the state directory",
    ("library.py", "_read_package_tree"): "the package's builtin skills",
    ("library.py", "Builtins.__init__"): "the package's builtin skills",
    ("library.py", "Library.enabled_overrides"): "skill settings in the state directory",
    ("library.py", "Library._save_settings"): "skill settings in the state directory",
    ("library.py", "Library._write_in_place"): "the document journal in the state directory",
    ("library.py", "Library._replay_journal"): "the document journal in the state directory",
    ("library.py", "Library.protected"): "realpath of a physical path already read from an fd (fs.fd_path)",
    ("tools/apply_patch.py", "_Files.open"): "the reference-compatible mode without a root (parity tests only)",
    ("tools/apply_patch.py", "_Files.makedirs"): "the reference-compatible mode without a root",
    ("tools/apply_patch.py", "_Files.unlink"): "the reference-compatible mode without a root",
    ("tools/apply_patch.py", "apply_patch"): "realpath of the cwd the gateway resolved beneath the root",
}


def filesystem_call(call: ast.Call) -> str | None:
    """What a call does to the filesystem by path ('os.unlink', 'open', ...), or None."""
    f = call.func
    if isinstance(f, ast.Name) and f.id == "open":
        return "open"
    if not isinstance(f, ast.Attribute):
        return None
    owner = f.value
    if isinstance(owner, ast.Name):
        if owner.id == "os" and f.attr in OS_PATH_CALLS:
            return f"os.{f.attr}"
        if owner.id in ("shutil", "glob") or (owner.id == "io" and f.attr == "open"):
            return f"{owner.id}.{f.attr}"
    if (isinstance(owner, ast.Attribute) and owner.attr == "path" and isinstance(owner.value, ast.Name)
            and owner.value.id == "os" and f.attr in OS_PATH_QUERIES):
        return f"os.path.{f.attr}"
    if f.attr in PATHLIB_ONLY:
        return f"pathlib .{f.attr}()"
    if isinstance(owner, ast.Call) and f.attr not in PATHLIB_PURE and getattr(
            owner.func, "id", getattr(owner.func, "attr", "")) in ("Path", "PosixPath"):
        return f"pathlib Path(...).{f.attr}()"
    return None


def fs_calls(tree: ast.AST):
    """(scope, call, what) for every call of ``tree`` that touches the filesystem by path;
    scope is 'Class.method' or 'function' (nested functions count as theirs)."""
    for node, where in scopes(tree):
        if isinstance(node, ast.Call):
            what = filesystem_call(node)
            if what:
                yield ".".join(where.split(".")[:2]), node, what


def filesystem_offences(sources: dict[str, str]) -> list[str]:
    found = []
    for module, text in sources.items():
        if module.startswith(FS_LAYER) or any(
                module == allowed or (allowed.endswith("/") and module.startswith(allowed))
                for allowed in FS_MODULES_ALLOWED):
            continue
        for scope, call, what in fs_calls(ast.parse(text, module)):
            if (module, scope) not in FS_FUNCTIONS_ALLOWED:
                found.append(f"kernel_gateway/{module}:{call.lineno} {scope or '<module>'}: {what}")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1].split()[0])))


def test_only_the_fs_layer_touches_paths():
    offences = filesystem_offences(package_sources())
    assert not offences, (
        "filesystem calls by path outside kernel_gateway/fs (use the confined layer, or, for a path that "
        "is never an agent's, add the function to FS_FUNCTIONS_ALLOWED saying why):\n" + "\n".join(offences))


def test_the_fs_allow_list_names_what_exists():
    """A stale entry would quietly allow a new function of the same name later."""
    sources = package_sources()
    for allowed in FS_MODULES_ALLOWED:
        assert any(m == allowed or (allowed.endswith("/") and m.startswith(allowed)) for m in sources), allowed
    for module, scope in FS_FUNCTIONS_ALLOWED:
        calling = {s for s, _, _ in fs_calls(ast.parse(sources[module]))}
        assert scope in calling, f"{module} {scope} is allowed but makes no filesystem call"


def test_the_fs_guard_catches_each_way():
    bad = '''
import os, shutil, glob, pathlib
def handler(root, name):
    open(name)
    os.open(name, os.O_RDONLY)
    os.unlink(os.path.join(root, name))
    os.path.isdir(name)
    shutil.rmtree(name)
    glob.glob(name + "/*")
    pathlib.Path(root).joinpath(name).read_text()
    pathlib.Path(name).unlink()
    os.fstat(3)  # an fd: fine
'''
    offences = filesystem_offences({"jupyter_api/contents.py": bad})
    kinds = [o.split(": ", 1)[1] for o in offences]
    assert kinds == ["open", "os.open", "os.unlink", "os.path.isdir", "shutil.rmtree", "glob.glob",
                     "pathlib .read_text()", "pathlib Path(...).unlink()"], offences
    # The same line in an allowed function of an allowed module is not an offence; elsewhere it is.
    assert not filesystem_offences({"state_files.py": bad})
    assert filesystem_offences({"library.py": bad})


# --- no environment built from request data but through request_env -------------------

ENV_CHECKER = "request_env.py"
# Where a mapping's "env" entry may be read: each is not request data, or is dropped.
ENV_READS_ALLOWED = {
    ("sandbox/profile.py", "validate_profile"),  # the operator's sandbox profile
    ("sandbox/profile.py", "compile_profile"),  # the same, compiled
    ("provisioner.py", "SandboxedKernelProvisioner.pre_launch"),  # jupyter_client's launch kwargs: the
    # gateway's own environment, which _sandbox_env filters to its allow-list
    ("server/jupyter_routes.py", "KernelsHandler.post"),  # a kernel start's env: type-checked, then dropped
}
# Where a process's environment may be passed on (env=/extra_env=), and why it is not the request's.
ENV_PASSED_ALLOWED = {
    ("job_runner.py", "_in_job_sandbox"),  # a job's env: request_env-checked, plus the gateway's own
    ("tools/command.py", "run_command.prepare"),  # a command's env: request_env-checked
    ("provisioner.py", "SandboxedKernelProvisioner.pre_launch"),  # _sandbox_env's allow-list
    ("sandbox/quota.py", "_run"),  # host tools: a fixed environment
    ("sandbox/profile.py", "compile_profile"),  # the profile's own process.env
    ("codex_runner.py", "prepare"),  # CODEX_HOME and the job's dummy token, the gateway's own
    ("jobs.py", "JobManager.submit"),  # the job record keeps the request_env-checked env
}
ENV_WRITES_ALLOWED = {
    ("lab/server.py", "main"),  # `kernel-gateway lab`'s own process: jupyter_server reads its token there
}


def _is_env_key(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "env"


def env_violations(sources: dict[str, str]) -> list[str]:
    found = []
    for path, text in sources.items():
        if path == ENV_CHECKER:
            continue
        tree = ast.parse(text, path)
        checked = set()  # env reads handed straight to request_env.check
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and call_name(node) == "check" and isinstance(node.func, ast.Attribute) \
                    and getattr(node.func.value, "id", "") == "request_env":
                checked.update(id(arg) for arg in node.args)
        for node, where in scopes(tree):
            where = where or "<module>"
            what = None
            if isinstance(node, ast.Subscript) and _is_env_key(node.slice):
                what = "reads an 'env' entry"
            elif isinstance(node, ast.Call) and call_name(node) in ("get", "pop", "setdefault") \
                    and node.args and _is_env_key(node.args[0]) and isinstance(node.func, ast.Attribute):
                what = "reads an 'env' entry"
            if what and (id(node) in checked or (path, where) in ENV_READS_ALLOWED):
                what = None
            if what is None and isinstance(node, ast.Call):
                if any(kw.arg in ("env", "extra_env") for kw in node.keywords) and (path, where) not in ENV_PASSED_ALLOWED:
                    what = "passes an environment (env=/extra_env=)"
                elif call_name(node) == "putenv" or (
                        call_name(node) in ("update", "setdefault", "__setitem__")
                        and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == "os.environ"):
                    what = "changes os.environ"
            if what is None and isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ" for t in targets):
                    what = "changes os.environ"
            if what and what == "changes os.environ" and (path, where) in ENV_WRITES_ALLOWED:
                what = None
            if what:
                found.append(f"{path}:{node.lineno} in {where}: {what}")
    return found


def test_no_environment_is_built_from_request_data_but_through_request_env():
    found = env_violations(package_sources())
    assert not found, (
        "a request's env becomes a process's environment only through request_env.check (its rule per kind: "
        "commands, command jobs' deny-list, codex jobs' allow-list); nothing else reads an 'env' entry, passes "
        "an environment on or changes the gateway's own:\n" + "\n".join(found)
    )


def test_the_env_guard_sees_each_way_around_request_env():
    bad = {
        "a.py": "def f(body):\n    return dict(body['env'])\n",
        "b.py": "def f(body, launch):\n    return launch.prepare({}, {}, extra_env=body.get('env', {}))\n",
        "c.py": "import subprocess\ndef f(cmd, e):\n    subprocess.run(cmd, env=e)\n",
        "d.py": "import os\ndef f(body):\n    os.environ.update(body)\n",
        "e.py": "import os\ndef f(v):\n    os.environ['HTTP_PROXY'] = v\n",
        "f.py": "import os\ndef f(v):\n    os.putenv('X', v)\n",
        "jobs.py": "def elsewhere(body):\n    return body.pop('env')\n",  # allowed only where it is
        "g.py": "def f(body, check):\n    return check(body.get('env'), 'command')\n",  # not request_env's check
    }
    found = env_violations(bad)
    assert sorted({f.split(":")[0] for f in found}) == sorted(bad), found
    assert not env_violations({
        ENV_CHECKER: bad["a.py"],
        "tools/x.py": "from .. import request_env\ndef f(body):\n    return request_env.check(body.get('env'), 'command')\n",
    })


# --- one HTTP base: every handler, one body parser, no disk work on the loop ----------------
#
# Every handler class the server routes to derives from server/base.py: BaseHandler (its JSON
# parser, its error renderer with the host-path scrub, its agent scoping); the kernel websocket is a
# WebSocketHandler over that same base.  Request data and kernel replies are parsed by the one
# bounded parser (kernel_gateway/json_input.py, which BaseHandler.json_value uses), never by
# json.loads, ast.literal_eval or jupyter_server's unbounded deserialize_binary_message.  And a
# handler method does no disk work on the loop: the library, Jupyter contents, notebooks and job
# patches are reached through BaseHandler.off_loop only.

HTTP_BASE = "BaseHandler"


def served_handlers() -> dict[str, type]:
    """Every handler class reachable from the apps the server builds (routes and defaults)."""
    from kernel_gateway.server import app as server_app
    from kernel_gateway.server.jupyter_channels import ChannelsHandler

    apps = {"control or agent socket": server_app.make_app(None), "agent socket": server_app.make_app(None, "a"),
            "Jupyter TCP port": server_app.make_jupyter_app(None)}
    found = {"the kernel websocket": ChannelsHandler}
    for name, application in apps.items():
        found.update(app_handlers(application, name))
    return found


def app_handlers(application, name: str) -> dict[str, type]:
    found = {}
    todo = [application.wildcard_router, application.default_router]
    while todo:
        router = todo.pop()
        for rule in getattr(router, "rules", []):
            target = rule.target
            if hasattr(target, "rules"):
                todo.append(target)
            elif isinstance(target, type):
                found[f"{name}: {rule.matcher.regex.pattern if hasattr(rule.matcher, 'regex') else rule.matcher}"] = target
    default = application.settings.get("default_handler_class")
    if default is not None:
        found[f"{name}: (no route)"] = default
    return found


def handlers_off_base(handlers: dict[str, type]) -> list[str]:
    from kernel_gateway.server.base import BaseHandler

    return sorted(f"{where}: {cls.__module__}.{cls.__qualname__}" for where, cls in handlers.items()
                  if not (isinstance(cls, type) and issubclass(cls, BaseHandler)))


def test_every_served_handler_derives_from_the_one_base():
    handlers = served_handlers()
    assert len(handlers) > 40  # the walk sees the routes (a walk that found none would pass anything)
    off = handlers_off_base(handlers)
    assert not off, ("every handler derives from server/base.py: BaseHandler (one body parser, one error "
                     "renderer, one agent scoping; a websocket is a WebSocketHandler over it):\n" + "\n".join(off))


def test_the_handler_guard_sees_a_handler_off_the_base():
    from tornado import web, websocket

    class Plain(web.RequestHandler):
        pass

    class Socket(websocket.WebSocketHandler):
        pass

    application = web.Application([(r"/plain", Plain), (r"/ws", Socket)], default_handler_class=Plain)
    off = handlers_off_base(app_handlers(application, "bad"))
    assert len(off) == 3 and all("Plain" in o or "Socket" in o for o in off), off


def handler_classes(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> names of its classes that derive (by name, across the modules) from a tornado handler."""
    classes: dict[str, list[tuple[str, set[str]]]] = {}
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text, module)):
            if isinstance(node, ast.ClassDef):
                bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                classes.setdefault(module, []).append((node.name, bases))
    handlers = {"RequestHandler", "WebSocketHandler", HTTP_BASE}
    grew = True
    while grew:
        grew = False
        for found in classes.values():
            for name, bases in found:
                if name not in handlers and bases & handlers:
                    handlers.add(name)
                    grew = True
    return {module: {n for n, _ in found if n in handlers} for module, found in classes.items()}


def derived_from(sources: dict[str, str], roots: set[str]) -> set[str]:
    """Names of the classes that derive (by name, across the modules) from one of ``roots``."""
    bases_of = {}
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text, module)):
            if isinstance(node, ast.ClassDef):
                bases_of.setdefault(node.name, set()).update(
                    b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases)
    found, grew = set(roots), True
    while grew:
        grew = False
        for name, bases in bases_of.items():
            if name not in found and bases & found:
                found.add(name)
                grew = True
    return found


def handlers_not_on_base(sources: dict[str, str]) -> list[str]:
    """Handler classes defined anywhere in the package that do not derive from BaseHandler."""
    on_base = derived_from(sources, {HTTP_BASE})
    return sorted(f"kernel_gateway/{module}: {name}" for module, names in handler_classes(sources).items()
                  for name in names if name != HTTP_BASE and name not in on_base)


def test_no_handler_class_anywhere_bypasses_the_base():
    """The static side of the walk above: a handler class defined anywhere derives from BaseHandler."""
    assert not handlers_not_on_base(package_sources()), handlers_not_on_base(package_sources())


def test_the_static_handler_guard_sees_a_class_off_the_base():
    bad = ("from tornado import web, websocket\n"
           "class Raw(web.RequestHandler):\n    pass\n"
           "class Ws(websocket.WebSocketHandler):\n    pass\n"
           "class Ok(websocket.WebSocketHandler, BaseHandler):\n    pass\n"
           "class AlsoOk(Ok):\n    pass\n")
    sources = {"server/base.py": "class BaseHandler(web.RequestHandler):\n    pass\n", "server/new.py": bad}
    assert handlers_not_on_base(sources) == ["kernel_gateway/server/new.py: Raw", "kernel_gateway/server/new.py: Ws"]


# Modules that handle request data or kernel messages: no parser but the bounded one.
PARSING_MODULES = ("server/", "jupyter_api/", "variables.py", "execution.py", "notebook_runs.py")
UNBOUNDED_PARSERS = {"loads", "load", "literal_eval", "deserialize_binary_message", "unpack", "deserialize"}
PARSERS_ALLOWED = {
    # The gateway's own files, never request data: written by the gateway, in its state directory.
    ("jupyter_api/tokens.py", "TokenStore.__init__"): "the token store in the state directory",
    ("jupyter_api/tokens.py", "TokenStore._load"): "the token store in the state directory",
    ("jupyter_api/kernelspecs.py", "KernelSpecs.__init__"): "the package's own kernel.json",
    ("jupyter_api/kernelspecs.py", "KernelSpecs._spec"): "the package's own kernel.json",
}


def parser_offences(sources: dict[str, str]) -> list[str]:
    found = []
    for module, text in sources.items():
        if not module.startswith(PARSING_MODULES):
            continue
        for node, where in scopes(ast.parse(text, module)):
            if not isinstance(node, ast.Call) or call_name(node) not in UNBOUNDED_PARSERS:
                continue
            owner = node.func.value if isinstance(node.func, ast.Attribute) else None
            owner_name = ast.unparse(owner) if owner is not None else ""
            if call_name(node) in ("loads", "load") and (owner_name == "json_input" or not node.args):
                continue  # the bounded one (any other module's loads, json under any alias, pickle, ... is not);
                # a load() of nothing reads no data it was handed (core.load(): the gateway's own state)
            if call_name(node) in ("unpack", "deserialize") and not owner_name.endswith("session"):
                continue  # struct.unpack and the like; a jupyter_client Session's are json.loads unbounded
            scope = ".".join(where.split(".")[:2])
            if (module, scope) not in PARSERS_ALLOWED:
                found.append(f"kernel_gateway/{module}:{node.lineno} {scope or '<module>'}: "
                             f"{owner_name + '.' if owner_name else ''}{call_name(node)}()")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1].split()[0])))


def test_request_data_and_kernel_replies_are_parsed_by_the_bounded_parser_only():
    offences = parser_offences(package_sources())
    assert not offences, (
        "request bodies, websocket frames and kernel replies are parsed by kernel_gateway/json_input.py "
        "(BaseHandler.json_value on a route): size checked first, depth, NaN and surrogates refused, never a "
        "throw; a file of the gateway's own goes in PARSERS_ALLOWED, saying why:\n" + "\n".join(offences))


def test_the_parser_guard_catches_each_unbounded_parser():
    bad = '''
import ast, json
from jupyter_server.services.kernels.connection.base import deserialize_binary_message
class H(BaseHandler):
    def post(self):
        body = json.loads(self.request.body)
        json.load(self.request.body_file)
        ast.literal_eval(self.get_argument("x"))
        deserialize_binary_message(self.request.body)
        self.session.unpack(b"{}")
        json_input.loads(b"{}", max_bytes=10)  # the bounded one: fine
        _json.loads(self.request.body)  # json imported under another name
        struct.unpack("!i", b"abcd")  # not JSON: fine
'''
    offences = parser_offences({"server/new_routes.py": bad})
    assert [o.split(": ", 1)[1] for o in offences] == [
        "json.loads()", "json.load()", "ast.literal_eval()", "deserialize_binary_message()", "self.session.unpack()",
        "_json.loads()",
    ], offences
    assert not parser_offences({"jupyter_api/tokens.py": "import json\nclass TokenStore:\n    def _load(self, f):\n"
                                                         "        return json.load(f)\n"})
    assert parser_offences({"jupyter_api/tokens.py": "import json\ndef other(f):\n    return json.load(f)\n"})


# Disk work a handler method must not do on the loop: calls on these objects, and these functions.
DISK_OBJECTS = {"library", "contents", "store", "notebooks"}  # self.core.library.x(), contents.get(), ...
DISK_FUNCTIONS = {"files_from_tar_gz", "patch_bytes", "read_patch"}
HANDLER_METHODS = {"get", "post", "put", "patch", "delete", "head", "options"}
DISK_WORK_ALLOWED = {
    # Validation without any disk access, on module functions of kernel_gateway.library.
    "library.check_skill_name", "library.check_document_name", "library.files_from_json",
}


def disk_work(call: ast.Call) -> str | None:
    """'self.core.library.list_skills' for a call that does disk work on an agent's tree, else None."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id if func.id in DISK_FUNCTIONS else None
    if not isinstance(func, ast.Attribute):
        return None
    text = ast.unparse(func)
    if text in DISK_WORK_ALLOWED:
        return None
    if func.attr in DISK_FUNCTIONS:
        return text
    owner = func.value
    names = set()
    while True:  # the names along self.core.library / self.contents() / contents
        if isinstance(owner, ast.Call):
            owner = owner.func
        if isinstance(owner, ast.Attribute):
            names.add(owner.attr)
            owner = owner.value
        elif isinstance(owner, ast.Name):
            names.add(owner.id)
            break
        else:
            break
    return text if names & DISK_OBJECTS else None


OFF_LOOP_CALLS = {"off_loop", "work", "changing"}  # BaseHandler.off_loop and the handlers' wrappers of it


def calls_on_the_loop(method: ast.AST):
    """The calls a handler method makes on the loop: all of them but those inside a nested function
    that the method hands to off_loop by name (``def save(): ...; await self.off_loop(save)``)."""
    handed = {arg.id for node in ast.walk(method) if isinstance(node, ast.Call) and call_name(node) in OFF_LOOP_CALLS
              for arg in node.args[:1] if isinstance(arg, ast.Name)}
    todo = list(ast.iter_child_nodes(method))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in handed:
            continue
        if isinstance(node, ast.Call):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def disk_work_on_the_loop(sources: dict[str, str]) -> list[str]:
    """Handler methods that call disk work themselves instead of handing it to off_loop."""
    found = []
    handlers = handler_classes(sources)
    for module, text in sources.items():
        if not handlers.get(module):
            continue
        for cls in ast.walk(ast.parse(text, module)):
            if not (isinstance(cls, ast.ClassDef) and cls.name in handlers[module]):
                continue
            for method in cls.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if method.name not in HANDLER_METHODS and not method.name.startswith("_"):
                    pass  # helpers are checked too: a handler calls them on the loop
                for node in calls_on_the_loop(method):
                    if True:
                        what = disk_work(node)
                        if what:
                            kind = "def" if isinstance(method, ast.FunctionDef) else "async def"
                            found.append(f"kernel_gateway/{module}:{node.lineno} {cls.name}.{method.name} "
                                         f"({kind}): {what}()")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1].split()[0])))


def test_no_handler_does_disk_work_on_the_loop():
    offences = disk_work_on_the_loop(package_sources())
    assert not offences, (
        "a handler hands disk work in an agent's tree (library, contents, notebooks, job patches) to "
        "self.off_loop(fn, ...) (a worker within the agent's share), never calls it on the loop:\n"
        + "\n".join(offences))


def test_the_disk_work_guard_sees_each_way():
    bad = '''
class Skills(BaseHandler):
    def get(self, agent):
        self.send_json(self.core.library.list_skills(agent))
class Docs(Skills):
    async def get(self, agent):
        self.send_json(self.core.library.get_document(agent, "SOUL.md"))
    async def put(self, agent):
        contents = self.contents()
        contents.save("x", {})
    def delete(self, agent):
        self.core.jupyter.contents(agent).delete("x")
    async def post(self, agent, job):
        data = self.core.jobs.patch_bytes(agent, job)
        files = library.files_from_tar_gz("n", b"")
class Nested(BaseHandler):
    async def put(self, agent):
        def save():
            return self.contents().save("x", {})
        def sneaky():
            return self.contents().delete("y")
        await self.off_loop(save)
        sneaky()
class Fine(BaseHandler):
    async def get(self, agent):
        self.send_json(await self.off_loop(self.core.library.list_skills, agent))
        await self.off_loop(self.contents().get, "x")
        library.check_skill_name("x")
class NotAHandler:
    def get(self):
        self.core.library.list_skills("a")
'''
    offences = disk_work_on_the_loop({"server/new_routes.py": bad})
    assert [o.split(" ", 1)[1] for o in offences] == [
        "Skills.get (def): self.core.library.list_skills()",
        "Docs.get (async def): self.core.library.get_document()",
        "Docs.put (async def): contents.save()",
        "Docs.delete (def): self.core.jupyter.contents(agent).delete()",
        "Docs.post (async def): self.core.jobs.patch_bytes()",
        "Docs.post (async def): library.files_from_tar_gz()",
        "Nested.put (async def): self.contents().delete()",  # sneaky() runs on the loop; save() is handed off
    ], offences


# --- no spawn outside the one launcher ----------------------------------------------------
#
# Every process the gateway starts for an agent is a sandbox, and sandbox/launch.py starts it:
# prepare() compiles the profile and the spawn helper's argv, spawn() and run_to_end() exec it with
# the fixed host environment and no preexec_fn.  Elsewhere only processes of the operator's own
# making may start, each named here with why.

LAUNCHER = "sandbox/launch.py"
SUBPROCESS_CALLS = {"Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}
OS_SPAWN_CALLS = {
    "system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp",
    "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe",
    "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
}
ASYNC_SPAWN_CALLS = {"create_subprocess_exec", "create_subprocess_shell", "subprocess_exec", "subprocess_shell"}
SPAWN_ALLOWED = {
    # jupyter_client's provisioner API wants a Popen it can poll: its argv and keyword arguments are
    # the prepared sandbox's (launch.prepare, spawn_kwargs), the same exec spawn() makes.
    ("provisioner.py", "SandboxedKernelProvisioner.launch_kernel"),
    # The spawn helper's Python twin: it is the exec in front of bwrap (run by launch.trampoline).
    ("sandbox/spawn_helper.py", "main"),
    # Host tools with fixed argv and a fixed environment: the agent's disk image (mkfs, mount, losetup).
    ("sandbox/quota.py", "_run"),
    # `bwrap --version` for /v1/info, and doctor's probes: the operator's own commands, fixed argv.
    ("server/app.py", "bwrap_version"),
    ("doctor.py", "_run"),
}


def spawn_call(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        if owner == "subprocess" and func.attr in SUBPROCESS_CALLS:
            return f"subprocess.{func.attr}()"
        if owner == "os" and func.attr in OS_SPAWN_CALLS:
            return f"os.{func.attr}()"
        if owner == "pty" and func.attr in ("spawn", "fork"):
            return f"pty.{func.attr}()"
        if func.attr in ASYNC_SPAWN_CALLS:
            return f"{func.attr}()"
    elif isinstance(func, ast.Name) and func.id in (SUBPROCESS_CALLS - {"run", "call"}) | ASYNC_SPAWN_CALLS:
        return f"{func.id}()"  # imported by name: from subprocess import Popen
    return None


def spawn_offences(sources: dict[str, str]) -> list[str]:
    found = []
    for path, text in sources.items():
        if path == LAUNCHER:
            continue
        for node, where in scopes(ast.parse(text, path)):
            what = spawn_call(node) if isinstance(node, ast.Call) else None
            if what and (path, where) not in SPAWN_ALLOWED:
                found.append(f"{path}:{node.lineno} in {where or '<module>'}: {what}")
    return found


def test_no_process_is_spawned_outside_the_one_launcher():
    found = spawn_offences(package_sources())
    assert not found, (
        "processes are started by sandbox/launch.py only (prepare, then spawn or run_to_end), so each is a "
        "sandbox from its first instruction with the fixed host environment:\n" + "\n".join(found)
    )


def test_the_spawn_allow_list_names_what_exists():
    sources = package_sources()
    seen = {(path, where) for path, text in sources.items() for node, where in scopes(ast.parse(text, path))
            if isinstance(node, ast.Call) and spawn_call(node)}
    assert SPAWN_ALLOWED <= seen, f"allowed but no longer spawning (remove them): {sorted(SPAWN_ALLOWED - seen)}"


def test_the_spawn_guard_sees_each_way_to_start_a_process():
    bad = {
        "a.py": "import subprocess\nsubprocess.Popen(['sh'])\n",
        "b.py": "import subprocess\ndef f():\n    subprocess.run(['sh'])\n",
        "c.py": "import os\ndef f():\n    os.system('sh')\n",
        "d.py": "import os\ndef f():\n    if os.fork() == 0:\n        os.execv('/bin/sh', ['sh'])\n",
        "e.py": "import asyncio\nasync def f():\n    await asyncio.create_subprocess_exec('sh')\n",
        "f.py": "from subprocess import Popen\nPopen(['sh'])\n",
        "g.py": "import os\nos.posix_spawn('/bin/sh', ['sh'], {})\n",
        "h.py": "async def f(loop):\n    await loop.subprocess_exec(object, 'sh')\n",
        "doctor.py": "import subprocess\ndef elsewhere():\n    subprocess.run(['sh'])\n",  # allowed only in _run
    }
    found = spawn_offences(bad)
    assert sorted({f.split(":")[0] for f in found}) == sorted(bad), found
    assert not spawn_offences({LAUNCHER: bad["a.py"], "doctor.py": "import subprocess\ndef _run():\n    subprocess.run([])\n"})

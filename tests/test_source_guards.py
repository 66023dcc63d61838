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

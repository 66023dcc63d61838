"""jlk, the skill's client, run as a real process against a real gateway with real kernels.

One gateway (``kernel-gateway serve`` in a temp directory) serves the whole
module; every test runs ``skills/jupyter-live-kernel/scripts/jlk`` as a
subprocess, the way an agent would, and checks its output, its exit code and
what it changed (the notebook file on disk, the kernel's state).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import nbformat
import pytest
from support import GatewayProcess

REPO = Path(__file__).resolve().parent.parent
JLK = str(REPO / "skills" / "jupyter-live-kernel" / "scripts" / "jlk")
AGENT = "alice"
NOTEBOOK = "user-files/analysis.ipynb"


def agent_root(gateway: GatewayProcess, agent: str = AGENT) -> Path:
    return Path(gateway.root) / agent


GATEWAY_AGENTS = (AGENT,)
GATEWAY_ARGS = ("--socket", "{tmp}/state/control.sock")


@pytest.fixture(scope="module")
def gateway(gw: GatewayProcess) -> GatewayProcess:
    return gw


@pytest.fixture(autouse=True)
def stop_sessions_afterwards(gateway: GatewayProcess):
    """Each test's kernels end with it: the gateway caps live sessions per agent."""
    yield
    _, listing = gateway.client.call("GET", f"/v1/agents/{AGENT}/sessions")
    for session in listing.get("sessions", []):
        gateway.client.call("DELETE", f"/v1/agents/{AGENT}/sessions/{quote(session['id'], safe='')}")


def clean_env(**extra: str) -> dict:
    """The test process's environment without any gateway variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KERNEL_GATEWAY_") and k != "JLK_SESSION"}
    env.update(extra)
    return env


@pytest.fixture
def jlk(gateway: GatewayProcess):
    """``jlk(*args, input=None, **env)``: run jlk on the control socket as agent alice."""

    def run(*args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess:
        environment = clean_env(**{"KERNEL_GATEWAY_CONTROL_SOCKET": gateway.socket, "KERNEL_GATEWAY_AGENT": AGENT,
                                   **env})
        result = subprocess.run(
            [sys.executable, JLK, *args],
            input=input if input is not None else "",
            capture_output=True, text=True, env=environment, timeout=180,
        )
        result.socket = environment["KERNEL_GATEWAY_CONTROL_SOCKET"]
        return result

    return run


def session_json(jlk, session: str) -> dict | None:
    listing = json.loads(jlk("sessions", "--json").stdout)["sessions"]
    return next((s for s in listing if s["id"] == session), None)


# --- execute ------------------------------------------------------------------------


def test_execute_prints_only_output_and_result_and_keeps_state(jlk):
    first = jlk("--session", "state", "execute", "--code", 'x = 41\nprint("hello")\nx + 1')
    assert (first.returncode, first.stdout, first.stderr) == (0, "hello\n42\n", "")

    second = jlk("execute", "--session", "state", "--code", "x")
    assert (second.returncode, second.stdout) == (0, "41\n")


def test_code_comes_from_stdin_or_a_file(jlk, tmp_path):
    piped = jlk("--session", "input", "execute", input="y = 6 * 7\nprint(y)\n")
    assert (piped.returncode, piped.stdout) == (0, "42\n")

    code_file = tmp_path / "cell.py"
    code_file.write_text("print(y + 1)\n")
    from_file = jlk("--session", "input", "execute", "--code-file", str(code_file))
    assert (from_file.returncode, from_file.stdout) == (0, "43\n")

    dash = jlk("--session", "input", "execute", "--code-file", "-", input="print(y - 1)")
    assert (dash.returncode, dash.stdout) == (0, "41\n")


def test_session_comes_from_jlk_session_and_ids_are_percent_encoded(jlk):
    odd = "scratch/one two?#"
    assert jlk("execute", "--code", "z = 'kept'", JLK_SESSION=odd).returncode == 0
    again = jlk("--session", odd, "execute", "--code", "print(z)")
    assert (again.returncode, again.stdout) == (0, "kept\n")
    assert session_json(jlk, odd)["state"] == "idle"


def test_a_cell_that_raises_exits_1_with_a_short_error(jlk):
    result = jlk("--session", "errors", "execute", "--code", "print('before')\n1/0")
    assert result.returncode == 1
    assert result.stdout.startswith("before\nZeroDivisionError: division by zero\n")
    assert "\x1b[" not in result.stdout  # no ANSI colour codes
    assert result.stderr == ""


def test_json_and_compact_print_the_structured_result(jlk):
    pretty = jlk("--session", "json", "execute", "--code", "print(1)\n2", "--json")
    data = json.loads(pretty.stdout)
    assert (pretty.returncode, data["status"], data["text"]) == (0, "ok", "1\n2\n")
    assert [o["output_type"] for o in data["outputs"]] == ["stream", "execute_result"]

    compact = jlk("--session", "json", "execute", "--code", "1/0", "--compact")
    assert compact.returncode == 1
    assert compact.stdout.count("\n") == 1
    assert json.loads(compact.stdout)["error"]["ename"] == "ZeroDivisionError"


def test_images_land_as_artifact_files(jlk):
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
    result = jlk("--session", "plots", "execute", "--code", code)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("[image/png saved to "))
    path = line[len("[image/png saved to "):-1]
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeout_exits_124_and_keeps_the_kernel(jlk):
    assert jlk("--session", "slow", "execute", "--code", "kept = 7").returncode == 0
    result = jlk("--session", "slow", "execute", "--code", "import time\ntime.sleep(60)", "--timeout", "1")
    assert result.returncode == 124
    assert "[timeout: the cell was interrupted" in result.stdout
    after = jlk("--session", "slow", "execute", "--code", "kept")
    assert (after.returncode, after.stdout) == (0, "7\n")


def test_a_dead_kernel_exits_4_and_the_next_call_gets_a_fresh_one(jlk):
    assert jlk("--session", "dies", "execute", "--code", "lost = 1").returncode == 0
    died = jlk("--session", "dies", "execute", "--code", "import os\nos._exit(1)")
    assert died.returncode == 4
    assert "died" in died.stdout

    fresh = jlk("--session", "dies", "execute", "--code", "lost")
    assert fresh.returncode == 1
    assert "NameError" in fresh.stdout
    assert "fresh kernel" in fresh.stdout


def test_restart_loses_variables_and_keeps_the_session(jlk):
    assert jlk("--session", "restart", "execute", "--code", "gone = 1").returncode == 0
    restarted = jlk("--session", "restart", "restart")
    assert (restarted.returncode, restarted.stdout) == (0, "restarted the kernel of session restart\n")
    after = jlk("--session", "restart", "execute", "--code", "gone")
    assert after.returncode == 1 and after.stdout.startswith("NameError")


def test_interrupt_answers(jlk):
    assert jlk("--session", "intr", "execute", "--code", "1").returncode == 0
    result = jlk("--session", "intr", "interrupt")
    assert (result.returncode, result.stdout) == (0, "interrupted the kernel of session intr\n")


def test_sessions_lists_and_stops(jlk):
    assert jlk("--session", "listed", "execute", "--code", "1").returncode == 0
    listing = jlk("sessions")
    assert listing.returncode == 0
    assert listing.stdout.splitlines()[0].split() == ["id", "state", "execution_count", "idle", "cwd"]
    assert any(line.split()[0] == "listed" for line in listing.stdout.splitlines()[1:])

    stopped = jlk("--session", "listed", "sessions", "stop")
    assert (stopped.returncode, stopped.stdout) == (0, "stopped session listed\n")
    assert session_json(jlk, "listed") is None


# --- the agent socket ---------------------------------------------------------------


def test_on_the_agent_socket_me_is_the_agent_and_others_are_out_of_reach(gateway, jlk):
    inside = clean_env(KERNEL_GATEWAY_SOCKET=gateway.agent_client(AGENT).socket_path, JLK_SESSION="inside")
    ran = subprocess.run([sys.executable, JLK, "execute", "--code", "import os\nprint(os.getcwd())"],
                         capture_output=True, text=True, env=inside, stdin=subprocess.DEVNULL)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip().startswith(str(agent_root(gateway) / "sessions"))

    other = subprocess.run([sys.executable, JLK, "--agent", "bob", "sessions"],
                           capture_output=True, text=True, env=inside, stdin=subprocess.DEVNULL)
    assert other.returncode == 2
    assert "out of reach" in other.stderr


# --- errors from the gateway and from the socket ----------------------------------------


def test_a_request_the_gateway_refuses_exits_2_with_its_message_and_hint(jlk):
    result = jlk("--agent", "nobody", "execute", "--code", "1")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "jlk: no agent 'nobody'",
        "hint: jlk cannot create agents: on the host, create it with "
        f"`curl -s --unix-socket {result.socket} -X PUT http://kg/v1/agents/nobody`",
    ]
    assert result.stdout == ""


def test_no_agent_on_the_control_socket_says_how_to_name_one(gateway):
    result = subprocess.run([sys.executable, JLK, "--socket", gateway.socket, "execute", "--code", "1"],
                            capture_output=True, text=True, env=clean_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert "hint: no agent was named: pass --agent NAME or set $KERNEL_GATEWAY_AGENT" in result.stderr


def test_a_missing_socket_exits_3_and_says_how_to_start_the_gateway(jlk, tmp_path):
    missing = str(tmp_path / "no-such.sock")
    result = jlk("--socket", missing, "execute", "--code", "1")
    assert result.returncode == 3
    assert f"cannot reach the kernel gateway at {missing} (--socket)" in result.stderr
    assert "kernel-gateway serve" in result.stderr


def test_a_dead_socket_file_exits_3(jlk, tmp_path):
    dead = str(tmp_path / "dead.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(dead)
    listener.close()  # the file stays, nobody listens: connection refused
    result = jlk("execute", "--code", "1", KERNEL_GATEWAY_CONTROL_SOCKET=dead)
    assert result.returncode == 3
    assert "($KERNEL_GATEWAY_CONTROL_SOCKET)" in result.stderr
    assert "kernel-gateway serve" in result.stderr


# --- usage errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "usage: jlk [options] COMMAND"),
        (("frobnicate",), "jlk: unknown command 'frobnicate'; commands: execute, contents"),
        (("execute", "--code", "1", "--bogus"), "jlk: `jlk execute` has no option --bogus (see"),
        (("execute", "--code", "1", "--timout", "3"),
         "jlk: `jlk execute` has no option --timout (did you mean --timeout?)"),
        (("edit", "--path", NOTEBOOK, "insert", "--at", "0", "--source", "1"), "has no option --at (see"),
        (("edit", "--path", NOTEBOOK, "insert", "--indx", "0", "--source", "1"),
         "`jlk edit insert` has no option --indx (did you mean --index?)"),
        (("edit", "--path", NOTEBOOK, "move", "--cell-id", "a", "--to-idx", "0"), "(did you mean --to-index?)"),
        (("exectue", "--code", "1"), "jlk: unknown command 'exectue' (did you mean execute?)"),
        (("variables", "lst"), "unknown action 'lst' for `jlk variables` (did you mean list?)"),
        (("execute", "-code", "1"), "jlk: unknown option -code (did you mean --code?)"),
        (("execute", "--code"), "jlk: --code needs a value (CODE)"),
        (("execute", "--code", "1", "--timeout", "soon"), "jlk: --timeout needs a number, got 'soon'"),
        (("execute", "--code", "1", "--timeout", "0"), "--timeout must be a positive number of seconds"),
        (("execute", "--code", "1", "--code-file", "x.py"), "give --code or --code-file, not both"),
        (("execute", "--code-file", "/nonexistent/cell.py"), "cannot read --code-file /nonexistent/cell.py"),
        (("execute",), "no code: stdin was empty; pass --code or --code-file"),
        (("execute", "--code", "1", "--code", "2"), "jlk: --code given twice"),
        (("execute", "--cell-id", "abc"), "--cell-id and --index name a notebook cell: add --path NOTEBOOK"),
        (("execute", "--path", NOTEBOOK, "--code", "1"), "--path runs a notebook cell: add --cell-id ID"),
        (("execute", "--code", "1", "--no-save-outputs"), "--no-save-outputs applies to a notebook cell"),
        (("execute", "--json=yes", "--code", "1"), "jlk: --json takes no value"),
        (("execute", "stray", "--code", "1"), "jlk: unexpected argument 'stray'"),
        (("contents",), "`jlk contents` needs --path"),
        (("edit", "--path", NOTEBOOK), "`jlk edit` needs an action: replace-source, insert"),
        (("edit", "--path", NOTEBOOK, "shuffle"), "unknown action 'shuffle' for `jlk edit`"),
        (("edit", "--path", NOTEBOOK, "delete"), "name the cell with --cell-id ID (see `jlk contents`) or --index N"),
        (("edit", "--path", NOTEBOOK, "insert", "--cell-type", "python", "--source", "1"),
         "--cell-type must be code, markdown or raw, not 'python'"),
        (("edit", "--path", NOTEBOOK, "move", "--cell-id", "abc"), "`jlk edit move` needs --to-index N"),
        (("edit", "--path", NOTEBOOK, "replace-source", "--cell-id", "a", "--index", "0", "--source", "x"),
         "give --cell-id or --index, not both"),
        (("variables",), "`jlk variables` needs an action: list or preview"),
        (("variables", "preview"), "`jlk variables preview` needs --name"),
        (("variables", "list", "--limit", "0"), "--limit must be at least 1"),
        (("run-all",), "`jlk run-all` needs --path"),
        (("sessions", "purge"), "unknown action 'purge' for `jlk sessions`"),
        (("execute", "-x"), "jlk: unknown option -x"),
        (("execute", "--code", "1", "--", "ls"), "`jlk execute` takes no arguments after --"),
        (("new",), "`jlk new` needs --path"),
        (("sh",), "no command: jlk sh 'COMMAND LINE' or jlk sh -- PROGRAM ARGS"),
        (("sh", "ls", "--", "ls"), "give a command line or -- PROGRAM ARGS, not both"),
        (("sh", "--"), "-- needs a program to run"),
        (("sh", "--timeout", "0", "true"), "--timeout must be a positive number of seconds"),
        (("sh", "--stdin", "/nonexistent/in.txt", "cat"), "cannot read --stdin /nonexistent/in.txt"),
        (("read",), "`jlk read` needs --path"),
        (("read", "--path", "SOUL.md", "--offset", "0"), "--offset must be at least 1"),
        (("read", "--path", "SOUL.md", "--limit", "x"), "--limit needs an integer, got 'x'"),
        (("patch",), "no patch: stdin was empty; pass --file"),
        (("patch", "--file", "/nonexistent/p.patch"), "cannot read --file /nonexistent/p.patch"),
    ],
)
def test_usage_errors_exit_2_with_a_clear_message_and_change_nothing(jlk, args, message):
    before = session_json(jlk, "usage")
    result = jlk("--session", "usage", *args)
    assert result.returncode == (255 if args[:1] == ("sh",) else 2)  # `jlk sh` keeps 0-254 for the command
    assert message in result.stderr
    assert result.stdout == ""
    assert session_json(jlk, "usage") == before  # no session was created or run


def test_help_on_every_level(jlk):
    top = jlk("--help")
    assert top.returncode == 0 and top.stdout.startswith("usage: jlk [options] COMMAND")
    assert "exit codes: 0 ok, 1 the cell raised" in top.stdout
    for command, actions in [
        ("execute", []), ("contents", []), ("restart", []), ("interrupt", []), ("run-all", []),
        ("restart-run-all", []), ("sessions", ["list", "stop"]),
        ("edit", ["replace-source", "insert", "delete", "move", "clear-outputs"]),
        ("variables", ["list", "preview"]), ("new", []), ("sh", []), ("read", []), ("patch", []),
    ]:
        page = jlk(command, "--help")
        assert page.returncode == 0 and page.stdout.startswith(f"usage: jlk {command}"), command
        assert "--socket PATH" in page.stdout
        for action in actions:
            assert action in page.stdout
            sub = jlk(command, action, "-h")
            assert sub.returncode == 0, (command, action)
            assert sub.stdout.startswith(f"usage: jlk {command}") and action in sub.stdout.splitlines()[0]
    assert "--no-save-outputs" in jlk("execute", "--help").stdout
    assert "--to-index N" in jlk("edit", "move", "--help").stdout


# --- notebooks -------------------------------------------------------------------------


@pytest.fixture
def notebook(gateway: GatewayProcess) -> Path:
    """A small notebook in alice's user-files, written fresh for each test."""
    path = agent_root(gateway) / NOTEBOOK
    path.parent.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Analysis", id="intro"),
        nbformat.v4.new_code_cell("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})",
                                  id="load"),
        nbformat.v4.new_code_cell("int(df['a'].sum())", id="total"),
    ]
    nbformat.write(nb, path)
    return path


def cell_sources(path: Path) -> list[tuple[str, str]]:
    return [(c.id, c.source) for c in nbformat.read(path, as_version=4).cells]


def test_notebook_loop_contents_edit_execute_and_clear(jlk, notebook):
    shown = jlk("contents", "--path", NOTEBOOK)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [
        f"{NOTEBOOK}: 3 cells",
        "[0] markdown intro",
        "    # Analysis",
        "[1] code load",
        "    import pandas as pd",
        "    df = pd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})",
        "[2] code total",
        "    int(df['a'].sum())",
    ]

    inserted = jlk("edit", "--path", NOTEBOOK, "insert", "--at-index", "3", "--source", "print(len(df))")
    assert inserted.returncode == 0, inserted.stderr
    new_id = inserted.stdout.split()[3]
    assert inserted.stdout == f"inserted code cell {new_id} at index 3 in {NOTEBOOK}\n"
    assert cell_sources(notebook)[3] == (new_id, "print(len(df))")

    replaced = jlk("edit", "--path", NOTEBOOK, "replace-source", "--cell-id", "total", "--source", "int(df['a'].sum()) * 10")
    assert (replaced.returncode, replaced.stdout) == (0, f"replaced the source of cell total in {NOTEBOOK}\n")
    assert cell_sources(notebook)[2] == ("total", "int(df['a'].sum()) * 10")

    assert jlk("--session", "nb", "execute", "--path", NOTEBOOK, "--cell-id", "load").returncode == 0
    ran = jlk("--session", "nb", "execute", "--path", NOTEBOOK, "--cell-id", "total")
    assert (ran.returncode, ran.stdout) == (0, "60\n")
    saved = nbformat.read(notebook, as_version=4).cells[2]
    assert saved.outputs[0]["data"]["text/plain"] == "60"
    assert saved.execution_count is not None

    unsaved = jlk("--session", "nb", "execute", "--path", NOTEBOOK, "--index", "3", "--no-save-outputs")
    assert (unsaved.returncode, unsaved.stdout) == (0, "3\n")
    assert nbformat.read(notebook, as_version=4).cells[3].outputs == []

    with_outputs = jlk("contents", "--path", NOTEBOOK, "--include-outputs")
    assert "    -- outputs --\n    60\n" in with_outputs.stdout

    moved = jlk("edit", "--path", NOTEBOOK, "move", "--cell-id", new_id, "--to-index", "0")
    assert (moved.returncode, moved.stdout) == (0, f"moved cell {new_id} to index 0 in {NOTEBOOK}\n")
    assert [i for i, _ in cell_sources(notebook)] == [new_id, "intro", "load", "total"]

    deleted = jlk("edit", "--path", NOTEBOOK, "delete", "--index", "0")
    assert (deleted.returncode, deleted.stdout) == (0, f"deleted cell {new_id} in {NOTEBOOK}\n")
    assert [i for i, _ in cell_sources(notebook)] == ["intro", "load", "total"]

    cleared = jlk("edit", "--path", NOTEBOOK, "clear-outputs")
    assert (cleared.returncode, cleared.stdout) == (0, f"cleared the outputs of every cell in {NOTEBOOK}\n")
    assert all(c.outputs == [] and c.execution_count is None
               for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code")


def test_insert_takes_index_like_every_other_action_and_at_index_still_works(jlk, notebook):
    first = jlk("edit", "--path", NOTEBOOK, "insert", "--index", "0", "--source", "'first'")
    assert first.returncode == 0, first.stderr
    old_spelling = jlk("edit", "--path", NOTEBOOK, "insert", "--at-index", "1", "--source", "'second'")
    assert old_spelling.returncode == 0, old_spelling.stderr
    assert [source for _, source in cell_sources(notebook)][:3] == ["'first'", "'second'", "# Analysis"]
    page = jlk("edit", "insert", "--help").stdout
    assert "--index N" in page and "--at-index" in page  # the old spelling is named where it is explained
    both = jlk("edit", "--path", NOTEBOOK, "insert", "--index", "0", "--at-index", "1", "--source", "x")
    assert both.returncode == 2 and "--index given twice" in both.stderr


def test_notebook_refusals_exit_2_and_leave_the_file_alone(jlk, notebook):
    before = notebook.read_bytes()
    out_of_range = jlk("edit", "--path", NOTEBOOK, "delete", "--index", "9")
    assert out_of_range.returncode == 2
    assert f"--index 9 is out of range: {NOTEBOOK} has 3 cells" in out_of_range.stderr

    unknown_cell = jlk("edit", "--path", NOTEBOOK, "replace-source", "--cell-id", "nope", "--source", "1")
    assert unknown_cell.returncode == 2
    assert "nope" in unknown_cell.stderr

    missing = jlk("contents", "--path", "user-files/missing.ipynb")
    assert missing.returncode == 2 and "missing.ipynb" in missing.stderr
    assert notebook.read_bytes() == before


def test_variables_list_and_dataframe_preview(jlk):
    code = "import pandas as pd\nframe = pd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})\ncount = 3"
    assert jlk("--session", "vars", "execute", "--code", code).returncode == 0

    listed = jlk("--session", "vars", "variables", "list")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert listed.stdout.splitlines()[0].split() == ["name", "type", "summary"]
    assert "DataFrame" in rows["frame"] and "int" in rows["count"]

    preview = jlk("--session", "vars", "variables", "preview", "--name", "frame")
    assert preview.returncode == 0, preview.stderr
    assert preview.stdout.startswith("frame: DataFrame")
    assert "3" in preview.stdout and "a" in preview.stdout and "object" in preview.stdout

    missing = jlk("--session", "vars", "variables", "preview", "--name", "nothing_here")
    assert missing.returncode == 2 and "nothing_here" in missing.stderr


def test_run_all_stops_at_the_error_and_restart_run_all_saves_outputs(jlk, notebook):
    broken = jlk("edit", "--path", NOTEBOOK, "insert", "--at-index", "2", "--source", "raise ValueError('bad row')")
    assert broken.returncode == 0, broken.stderr
    broken_id = broken.stdout.split()[3]

    stopped = jlk("--session", "runall", "run-all", "--path", NOTEBOOK)
    assert stopped.returncode == 1
    assert "ValueError: bad row" in stopped.stdout
    assert f"stopped at cell {broken_id}" in stopped.stdout
    assert "cell total" not in stopped.stdout  # nothing after the error ran

    assert jlk("edit", "--path", NOTEBOOK, "delete", "--cell-id", broken_id).returncode == 0
    verified = jlk("--session", "runall", "restart-run-all", "--path", NOTEBOOK, "--save-outputs")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.splitlines()[-2:] == ["ok: ran 2 cells", "outputs saved to the notebook"]
    saved = nbformat.read(notebook, as_version=4).cells[2]
    assert saved.outputs[0]["data"]["text/plain"] == "6"


# --- inside the agent's sandbox ----------------------------------------------------------


def sandboxed_command(gateway: GatewayProcess, command: str) -> dict:
    """Run ``command`` through the gateway's command tool: bwrap, the agent's tree, its socket."""
    status, result = gateway.client.call("POST", f"/v1/agents/{AGENT}/commands", {"command": command})
    assert status == 200, result
    return result


def test_jlk_in_a_sandboxed_command_reaches_only_its_own_agent(gateway):
    # The skill's script as an agent would have it in its own tree (jlk on PATH is the same file).
    (agent_root(gateway) / "user-files").mkdir(exist_ok=True)
    script = agent_root(gateway) / "user-files" / "jlk"
    script.write_bytes(Path(JLK).read_bytes())

    ran = sandboxed_command(gateway, "python3 user-files/jlk --session boxed execute --code 'print(6 * 7)'")
    assert (ran["exit_code"], ran["stdout"], ran["stderr"]) == (0, "42\n", "")

    foreign = sandboxed_command(gateway, "python3 user-files/jlk --agent bob sessions")
    assert foreign["exit_code"] == 2
    assert foreign["stderr"] == "jlk: this socket belongs to agent 'alice'; 'bob' is out of reach\n"

    control = sandboxed_command(gateway, f"python3 user-files/jlk --socket {gateway.socket} sessions")
    assert control["exit_code"] == 3  # the control socket is not in the sandbox


def test_jlk_from_a_kernel_cell_runs_in_another_session(jlk, gateway):
    script = agent_root(gateway) / "user-files" / "jlk"
    script.parent.mkdir(exist_ok=True)
    script.write_bytes(Path(JLK).read_bytes())
    # The kernel has KERNEL_GATEWAY_SOCKET and JLK_SESSION; calling its own session would wait for itself.
    code = (
        "import os, subprocess\n"
        f"r = subprocess.run(['python3', {str(script)!r}, '--session', 'helper', 'execute', '--code', 'print(7)'],\n"
        "                   capture_output=True, text=True)\n"
        "print(os.environ['JLK_SESSION'], r.returncode, r.stdout.strip())"
    )
    result = jlk("--session", "caller", "execute", "--code", code)
    assert (result.returncode, result.stdout) == (0, "caller 0 7\n")


def test_skill_front_matter_names_the_skill_and_enables_it_by_default():
    text = (REPO / "skills" / "jupyter-live-kernel" / "SKILL.md").read_text()
    assert text.startswith("---\n")
    front = text.split("---\n")[1].splitlines()
    assert "name: jupyter-live-kernel" in front
    assert any(line.startswith("description: ") and "stateful" in line for line in front)
    assert front[front.index("metadata:") + 1] == "  default_enabled: true"


# --- sh, read, patch, new: the gateway's other tools -----------------------------------


def test_sh_runs_where_the_sessions_kernel_runs_and_names_the_session(jlk, gateway):
    wrote = jlk("--session", "shared", "execute", "--code", "open('from-kernel.txt', 'w').write('kernel\\n')")
    assert wrote.returncode == 0, wrote.stdout + wrote.stderr
    ran = jlk("--session", "shared", "sh", 'cat from-kernel.txt; echo "$JLK_SESSION"; ls "$KERNEL_GATEWAY_AGENT_ROOT"')
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[:2] == ["kernel", "shared"]
    assert "user-files" in lines[2:] and "sessions" in lines[2:]
    # And back: what the command writes relative, the kernel reads relative.
    assert jlk("--session", "shared", "sh", "echo shell > from-shell.txt").returncode == 0
    back = jlk("--session", "shared", "execute", "--code", "print(open('from-shell.txt').read().strip())")
    assert (back.returncode, back.stdout) == (0, "shell\n")


def test_sh_exit_codes_argv_stdin_and_cwd(jlk, tmp_path):
    failed = jlk("sh", "echo out; echo err >&2; exit 3")  # the command's own code, as ssh gives it
    assert (failed.returncode, failed.stdout, failed.stderr) == (3, "out\n", "err\n[exit code 3]\n")
    killed = jlk("sh", "kill -9 $$")
    assert (killed.returncode, killed.stderr) == (128 + 9, "[killed by SIGKILL]\n")

    argv = jlk("sh", "--", "printf", "%s|", "a b", "$HOME")
    assert (argv.returncode, argv.stdout) == (0, "a b|$HOME|")  # no shell: nothing expanded

    given = tmp_path / "in.txt"
    given.write_text("from a file\n")
    assert jlk("sh", "--stdin", str(given), "cat").stdout == "from a file\n"
    assert jlk("sh", "--stdin", "-", "tr a-z A-Z", input="piped\n").stdout == "PIPED\n"

    where = jlk("sh", "--cwd", "user-files", "pwd")
    assert where.stdout.strip().endswith(f"/{AGENT}/user-files")

    slow = jlk("sh", "--timeout", "1", "sleep 30")
    assert slow.returncode == 124
    assert slow.stderr.endswith("[timeout: the command was killed after 1 s]\n")

    as_json = jlk("sh", "--json", "exit 5")
    assert as_json.returncode == 5 and json.loads(as_json.stdout)["exit_code"] == 5

    # jlk's own failures under `jlk sh` exit 255 (ssh's code), never a code the command could mean.
    outside = jlk("sh", "--cwd", "/etc", "pwd")
    assert outside.returncode == 255 and "outside" in outside.stderr
    assert "hint: use a path inside your agent root" in outside.stderr
    assert jlk("sh", "--bogus", "true").returncode == 255
    assert jlk("sh", "--timeout").returncode == 255
    unreachable = jlk("sh", "exit 3", KERNEL_GATEWAY_CONTROL_SOCKET=str(tmp_path / "none.sock"))
    assert unreachable.returncode == 255 and "cannot reach the kernel gateway" in unreachable.stderr
    assert "jlk sh" in jlk("--help").stdout.split("exit codes:")[1] and "255" in jlk("--help").stdout


def test_sh_passes_piped_stdin_through_as_ssh_does(jlk, tmp_path):
    piped = jlk("sh", "wc -l", input="a\nb\n")
    assert (piped.returncode, piped.stdout.strip()) == (0, "2")
    exact = jlk("sh", "--", "od", "-An", "-c", input="x\r\ny")  # bytes as they are: no newline translation
    assert exact.stdout.split() == ["x", "\\r", "\\n", "y"]
    assert jlk("sh", "--no-stdin", "wc -l", input="a\nb\n").stdout.strip() == "0"
    assert jlk("sh", "--stdin", "-", "wc -l", input="a\nb\nc\n").stdout.strip() == "3"
    both = jlk("sh", "--stdin", "-", "--no-stdin", "true")
    assert both.returncode == 255 and "give --stdin FILE or --no-stdin, not both" in both.stderr
    binary = subprocess.run([sys.executable, JLK, "sh", "cat"], input=b"\xff\xfe", capture_output=True,
                            env=clean_env(KERNEL_GATEWAY_CONTROL_SOCKET=piped.socket, KERNEL_GATEWAY_AGENT=AGENT))
    assert binary.returncode == 255 and b"not UTF-8 text" in binary.stderr


def test_read_prints_lines_and_says_where_more_follow(jlk, gateway):
    data = agent_root(gateway) / "user-files" / "lines.txt"
    data.parent.mkdir(exist_ok=True)
    data.write_text("".join(f"line {i}\n" for i in range(1, 11)))
    window = jlk("read", "--path", "user-files/lines.txt", "--offset", "3", "--limit", "2")
    assert (window.returncode, window.stdout) == (0, "line 3\nline 4\n")
    assert window.stderr == "[lines 3-4 of 10: --offset 5 reads on]\n"
    whole = jlk("read", "--path", "user-files/lines.txt")
    assert (whole.returncode, whole.stdout, whole.stderr) == (0, data.read_text(), "")

    missing = jlk("read", "--path", "user-files/none.txt")
    assert missing.returncode == 2 and "none.txt" in missing.stderr and missing.stdout == ""


def test_patch_from_stdin_or_a_file_and_a_failed_patch_exits_1_with_codex_text(jlk, gateway, tmp_path):
    target = agent_root(gateway) / "user-files" / "notes.md"
    target.parent.mkdir(exist_ok=True)
    target.unlink(missing_ok=True)
    add = "*** Begin Patch\n*** Add File: user-files/notes.md\n+one\n+two\n*** End Patch\n"
    added = jlk("patch", input=add)
    assert (added.returncode, added.stdout) == (0, "Success. Updated the following files:\nA user-files/notes.md\n")
    assert target.read_text() == "one\ntwo\n"

    patch_file = tmp_path / "change.patch"
    patch_file.write_text("*** Begin Patch\n*** Update File: notes.md\n@@\n-two\n+TWO\n*** End Patch\n")
    updated = jlk("patch", "--file", str(patch_file), "--cwd", "user-files")
    assert (updated.returncode, updated.stdout) == (0, "Success. Updated the following files:\nM notes.md\n")
    assert target.read_text() == "one\nTWO\n"

    bad = "*** Begin Patch\n*** Update File: user-files/notes.md\n@@\n-three\n+3\n*** End Patch\n"
    failed = jlk("patch", input=bad)
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.startswith(f"Failed to find expected lines in {target}:\nthree\n")
    assert "hint: nothing was changed; the file is not what the patch expects: read it again (`jlk read --path FILE`)" \
        in failed.stderr
    assert target.read_text() == "one\nTWO\n"

    as_json = jlk("patch", "--json", input=bad)
    body = json.loads(as_json.stdout)
    assert as_json.returncode == 1
    assert body["error"]["code"] == "patch_failed" and body["error"]["message"] == body["output"]


def test_new_creates_an_empty_notebook_and_never_replaces_one(jlk, gateway):
    path = "user-files/fresh/made.ipynb"
    on_disk = agent_root(gateway) / path
    if on_disk.exists():
        on_disk.unlink()
    missing = jlk("edit", "--path", path, "insert", "--source", "1")
    assert missing.returncode == 2
    assert missing.stderr.endswith(f"hint: create it with `jlk new --path {path}`\n")
    assert not on_disk.exists()

    made = jlk("new", "--path", path)
    assert (made.returncode, made.stdout) == (0, f"created {path}: an empty notebook for the sandboxed Python kernel\n")
    nb = nbformat.read(on_disk, as_version=4)
    nbformat.validate(nb)
    assert nb.cells == [] and nb.metadata.kernelspec.name == "python3"

    assert jlk("edit", "--path", path, "insert", "--source", "6 * 7").returncode == 0
    before = on_disk.read_bytes()
    again = jlk("new", "--path", path)
    assert again.returncode == 2
    assert again.stderr.startswith(f"jlk: {path} exists already (1 cells)\nhint: change it with `jlk edit")
    assert on_disk.read_bytes() == before


def test_hints_are_jlk_commands_not_http_routes(jlk):
    unknown = jlk("--session", "never-started", "variables", "list")
    assert unknown.returncode == 2
    assert unknown.stderr.splitlines() == [
        "jlk: no session 'never-started' for agent 'alice'",
        "hint: `jlk --session never-started execute --code ...` starts it; `jlk sessions` lists the live ones",
    ]
    assert "/v1/" not in jlk("--session", "never-started", "interrupt").stderr


def test_patch_hints_fit_the_failure(jlk, gateway):
    files = agent_root(gateway) / "user-files"
    files.mkdir(exist_ok=True)
    (files / "hinted.md").write_text("one\n")

    def hint(patch):
        done = jlk("patch", input=patch)
        assert done.returncode == 1 and done.stdout == "", done.stderr
        return done.stderr.splitlines()[-1]

    begin, end = "*** Begin Patch\n", "*** End Patch\n"
    outside = hint(f"{begin}*** Update File: /etc/hostname\n@@\n-a\n+b\n{end}")
    assert outside.startswith("hint: nothing was changed; patch paths are relative to the agent root")
    missing = hint(f"{begin}*** Update File: hinted-not-here.md\n@@\n-a\n+b\n{end}")
    assert missing.startswith("hint: nothing was changed; no such file: paths are relative to the agent root")
    assert "user-files/" in missing and "*** Add File:" in missing
    stale = hint(f"{begin}*** Update File: user-files/hinted.md\n@@\n-two\n+2\n{end}")
    assert stale.startswith("hint: nothing was changed; the file is not what the patch expects: read it again "
                            "(`jlk read --path FILE`)")
    malformed = hint("*** Update File: user-files/hinted.md\n")
    assert malformed.startswith("hint: nothing was changed; a patch is *** Begin Patch, then")
    partly = hint(f"{begin}*** Add File: user-files/hinted-new.md\n+x\n*** Update File: user-files/hinted.md\n"
                  f"@@\n-two\n+2\n{end}")
    assert partly.startswith("hint: the hunks before the failing one were applied; the file is not what")
    assert (files / "hinted.md").read_text() == "one\n"


def test_read_and_other_refusals_hint_jlk_commands(jlk, gateway):
    (agent_root(gateway) / "user-files").mkdir(exist_ok=True)
    for args, expected in (
        (("read", "--path", "user-files"), "hint: list it with `jlk sh 'ls $KERNEL_GATEWAY_AGENT_ROOT/user-files'`"),
        (("read", "--path", "no-such-file.txt"), "hint: paths are relative to the agent root, e.g. user-files/"),
    ):
        done = jlk(*args)
        assert done.returncode == 2
        hints = [line for line in done.stderr.splitlines() if line.startswith("hint: ")]
        assert hints and hints[0].startswith(expected), done.stderr
        for http in ("GET ", "POST ", ".../", "/v1/", "the command tool", "raw=true"):
            assert http not in done.stderr, done.stderr


def test_the_last_line_of_a_cut_output_names_the_file_with_all_of_it(jlk):
    ran = jlk("--session", "big", "execute", "--code", "for i in range(200000): print(i)")
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "0" and "199999" in lines
    last = lines[-1]
    assert last.startswith("[output cut: ") and " bytes not shown; full output in " in last, last
    spill = Path(last.split(" full output in ", 1)[1].rstrip("]"))
    assert spill.read_text() == "".join(f"{i}\n" for i in range(200000))
    assert len(ran.stdout.encode()) < 72 << 10  # the default budget: 64 KiB kept, head and tail
    # stderr after a cut stdout: jlk's own last line still names the file.
    mixed = jlk("--session", "big", "execute", "--code",
                "import sys\nfor i in range(100000): print(i)\nprint('late', file=sys.stderr)")
    assert mixed.stdout.splitlines()[-1].startswith("[output cut; the full output is in "), mixed.stdout[-300:]


def test_execute_and_run_all_print_a_figure_the_same_way(jlk, gateway):
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
    path = "user-files/same-figure.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code, id="plot")]
    nbformat.write(nb, agent_root(gateway) / path)
    executed = jlk("--session", "figure", "execute", "--code", code)
    ran = jlk("--session", "figure", "run-all", "--path", path)
    assert executed.returncode == 0 and ran.returncode == 0, executed.stderr + ran.stderr
    import re
    masked = lambda text: re.sub(r"saved to \S+\.png", "saved to FILE.png", text)  # noqa: E731
    assert masked(executed.stdout) == "[image/png saved to FILE.png]\n"
    assert masked(ran.stdout).splitlines()[1:-1] == ["    [image/png saved to FILE.png]"]


def test_output_closed_early_exits_141_without_a_traceback(gateway):
    env = clean_env(KERNEL_GATEWAY_CONTROL_SOCKET=gateway.socket, KERNEL_GATEWAY_AGENT=AGENT)
    # `jlk ... | head -1`: the reader takes one line and goes away.  The text jlk prints
    # (two bounded streams and a bounded result) is well over a pipe's 64 KiB, so jlk is
    # still writing when the reader leaves.
    pipeline = subprocess.run(
        ["bash", "-c", f'set -o pipefail; "{sys.executable}" "{JLK}" --session pipe execute '
                       "--code 'import sys\nfor i in range(200000): print(i)\nsys.stderr.write(\"x\" * 200000)\n"
                       "\"y\" * 200000' | head -1"],
        capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=120,
    )
    assert pipeline.stdout == "0\n"
    assert pipeline.returncode == 141
    assert pipeline.stderr == ""


def test_a_timeout_waiting_for_a_busy_session_says_only_that_the_code_did_not_run(gateway, jlk):
    env = clean_env(KERNEL_GATEWAY_CONTROL_SOCKET=gateway.socket, KERNEL_GATEWAY_AGENT=AGENT)
    assert jlk("--session", "busy", "execute", "--code", "1").returncode == 0
    first = subprocess.Popen([sys.executable, JLK, "--session", "busy", "execute", "--code",
                              "import time\nprint('started', flush=True)\ntime.sleep(8)"],
                             stdout=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)
    try:
        assert session_wait_busy(jlk, "busy")
        queued = jlk("--session", "busy", "execute", "--timeout", "1", "--code", "print('never')")
        assert queued.returncode == 124
        assert queued.stdout == ("The session 'busy' was busy with another execution for the whole timeout (1 s); "
                                 "this code did not run.\n")
    finally:
        first.wait(timeout=60)


def session_wait_busy(jlk, session: str) -> bool:
    from support import wait_until
    return wait_until(lambda: (session_json(jlk, session) or {}).get("state") == "busy", timeout=30)


def test_the_note_after_a_kernel_death_is_one_sentence(jlk):
    assert jlk("--session", "dies3", "execute", "--code", "import os\nos._exit(3)").returncode == 4
    fresh = jlk("--session", "dies3", "execute", "--code", "print('again')")
    assert fresh.returncode == 0
    assert fresh.stdout == (
        "again\n[note: The previous kernel of this session died (exit code 3), and every variable, import and "
        "open file with it; this is a fresh kernel.]\n"
    )


def test_run_all_prints_where_images_went(jlk, gateway):
    path = "user-files/plots.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()",
                                          id="plot")]
    nbformat.write(nb, agent_root(gateway) / path)
    ran = jlk("--session", "plots-run", "run-all", "--path", path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    saved = [line.strip() for line in ran.stdout.splitlines() if line.strip().startswith("[image/png saved to ")]
    assert len(saved) == 1
    image = Path(saved[0][len("[image/png saved to "):-1])
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- how errors read ----------------------------------------------------------------


def test_an_error_deep_in_a_library_still_shows_the_users_lines(jlk):
    code = "import json\ndef load(text):\n    return json.loads(text)\nload('{')"
    result = jlk("--session", "deep", "execute", "--code", code)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("json.decoder.JSONDecodeError: Expecting property name") or \
        lines[0].startswith("JSONDecodeError: Expecting property name"), lines[0]
    assert lines[1] == "Traceback (last frames):"
    text = result.stdout
    assert "----> 4 load('{')" in text  # the cell's own line
    assert "----> 3     return json.loads(text)" in text  # and the user's function
    assert "json/decoder.py" in text  # plus the last library frames
    assert "[... 1 frame ...]" in text
    # Library frames are their location and running line only: the output stays short.
    assert len(lines) < 20


def test_deep_recursion_in_a_cell_stays_within_the_bound(jlk):
    code = "def down(n):\n    return 1 / 0 if n == 0 else down(n - 1)\ndown(60)"
    result = jlk("--session", "recurse", "execute", "--code", code)
    assert result.returncode == 1
    frames = [line for line in result.stdout.splitlines() if line.startswith("Cell In[")]
    assert len(frames) == 3  # the outermost cell frame and the two innermost ones
    assert "----> 3 down(60)" in result.stdout
    assert "[... 59 frames ...]" in result.stdout


def test_a_syntax_error_names_the_cell_and_shows_the_caret(jlk):
    result = jlk("--session", "syntax", "execute", "--code", "y = 1\nx = 1 +* 2")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("SyntaxError: invalid syntax (Cell In[") and lines[0].endswith("], line 2)")
    assert lines[1:] == ["    x = 1 +* 2", "           ^"]
    as_json = json.loads(jlk("--session", "syntax", "execute", "--code", "if True:\nprint(1)", "--json").stdout)
    assert as_json["error"]["ename"] == "IndentationError"
    assert "(Cell In[" in as_json["error"]["evalue"] and ".py" not in as_json["error"]["evalue"]


# --- jlk's own HTTP: every answer shape a server may give, and garbage ---------------------


def serve_once(path: Path, answer: bytes) -> "threading.Thread":
    """A Unix socket at ``path`` that reads one request and sends ``answer`` as it is, then closes."""
    import threading

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def run():
        connection, _ = server.accept()
        with connection:
            data = b""
            while b"\r\n\r\n" not in data:
                data += connection.recv(65536)
            connection.sendall(answer)
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("shape", ["content-length", "chunked", "until-close"])
def test_jlk_reads_every_answer_shape(tmp_path, shape):
    body = json.dumps({"sessions": [{"id": "s1", "state": "idle"}]}).encode()
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    answer = {
        "content-length": head + b"Content-Length: %d\r\n\r\n" % len(body) + body,
        "chunked": head + b"Transfer-Encoding: chunked\r\n\r\n"
                   + b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:])) + b"0\r\n\r\n",
        "until-close": head + b"Connection: close\r\n\r\n" + body,
    }[shape]
    thread = serve_once(tmp_path / "gw.sock", answer)
    done = subprocess.run([sys.executable, JLK, "--socket", str(tmp_path / "gw.sock"), "--agent", "a", "sessions",
                           "--json"], capture_output=True, text=True, timeout=60, env=clean_env())
    thread.join(timeout=30)
    assert (done.returncode, json.loads(done.stdout)) == (0, json.loads(body)), done.stderr


@pytest.mark.parametrize("answer", [b"", b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n{}",
                                    b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\n{}",
                                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"])
def test_a_broken_answer_exits_3_without_a_traceback(tmp_path, answer):
    thread = serve_once(tmp_path / "gw.sock", answer)
    done = subprocess.run([sys.executable, JLK, "--socket", str(tmp_path / "gw.sock"), "--agent", "a", "sessions"],
                          capture_output=True, text=True, timeout=60, env=clean_env())
    thread.join(timeout=30)
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith("jlk: cannot reach the kernel gateway") and "Traceback" not in done.stderr

"""JupyterLab from ``kernel-gateway lab``, in a real browser: headless Chromium driven by playwright.

Against a real gateway and a real ``kernel-gateway lab alice``: the notebook
the agent ran through jlk opens on the agent's live kernel; what the browser
defines, jlk reads back; the agent's edits and runs appear in the open page
(jupyter-collaboration) with no reload dialog; interrupt and restart from the
toolbar; the file browser shows the agent's tree and nothing else.

Playwright cannot download its browsers here: it drives Debian's chromium
(``/usr/bin/chromium``, or ``$KG_CHROMIUM``).  Without one these tests skip,
except in CI (``CI=true``), where they fail.  Screenshots are saved under
``tests/artifacts/`` (the path is printed).  No timing asserts: every wait is
playwright's own, with generous timeouts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lab_support import LabProcess

GATEWAY_ARGS = ("--jupyter-port", "0", "--Gateway.spare_kernels=False")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
JLK = str(Path(__file__).resolve().parent.parent / "skills" / "jupyter-live-kernel" / "scripts" / "jlk")
CHROMIUM = os.environ.get("KG_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook in front
WAIT = 120_000  # ms: JupyterLab on a busy 2-core machine
IN_CI = os.environ.get("CI") == "true"


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright; scripts/install.sh does)"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"no chromium at {CHROMIUM} (apt-get install chromium; scripts/install.sh does as root)"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = _browser_missing()
    if missing:
        if IN_CI:
            pytest.fail(f"browser tests cannot run in CI: {missing}")
        pytest.skip(f"browser tests skipped: {missing}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: chromium's own sandbox needs an unprivileged user; the tests may run as root.
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def lab(gw, tmp_path_factory, browser):
    log = tmp_path_factory.mktemp("lab") / "lab.log"
    print(f"\nJupyterLab's log: {log}")
    process = LabProcess(gw, "alice", str(log), "--log-level", "INFO").start()
    yield process
    process.stop()


@pytest.fixture
def page(browser, lab, request):
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(WAIT)
    tab = context.new_page()
    yield tab
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"{request.node.name}.png"
    try:
        tab.screenshot(path=str(shot))
        print(f"\nscreenshot: {shot}")
    finally:
        context.close()


def jlk(gw, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JLK_SESSION"}
    done = subprocess.run([sys.executable, JLK, "--socket", gw.socket, "--agent", "alice", *args],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def agent_notebook(gw, *sources: str) -> str:
    """A notebook the agent made with jlk; returns its path."""
    path = f"user-files/nb-{uuid.uuid4().hex[:8]}.ipynb"
    jlk(gw, "new", "--path", path)
    for source in sources:
        jlk(gw, "edit", "--path", path, "insert", "--source", source)
    return path


def open_notebook(page, lab, path: str):
    from playwright.sync_api import expect

    # A workspace of its own: JupyterLab would otherwise reopen the notebooks of earlier tests.
    page.goto(f"{lab.base}/lab/workspaces/t-{uuid.uuid4().hex[:8]}/tree/{path}?token={lab.token}")
    page.wait_for_selector(f"{PANEL} .jp-Notebook .jp-Cell")
    expect(page.locator(f"{PANEL} .jp-Notebook-ExecutionIndicator")).to_have_attribute("data-status", "idle")


def run_new_cell(page, code: str) -> None:
    """Append a cell at the end of the open notebook, type ``code`` and run it."""
    page.locator(f"{PANEL} .jp-Notebook .jp-Cell").last.click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # command mode: a new cell below
    page.keyboard.press("Enter")
    page.keyboard.type(code)
    page.keyboard.press("Shift+Enter")


def output_with(page, text: str):
    return page.locator(f"{PANEL} .jp-OutputArea-output").filter(has_text=text)


def gateway_sessions(gw) -> dict:
    return {s["id"]: s for s in gw.client.call("GET", "/v1/agents/alice/sessions")[1]["sessions"]}


def test_a_notebook_the_agent_ran_shows_its_variables_in_a_new_cell(gw, lab, page):
    from playwright.sync_api import expect

    path = agent_notebook(gw, "import statistics\nrainfall_mm = [12.5, 30.1, 7.4, 22.0]\n"
                              "mean_rain = round(statistics.mean(rainfall_mm), 2)\nprint('agent: mean', mean_rain)")
    assert jlk(gw, "execute", "--path", path, "--index", "0").stdout.strip() == "agent: mean 18.0"
    open_notebook(page, lab, path)
    expect(output_with(page, "agent: mean 18.0")).to_be_visible()  # the agent's saved output
    run_new_cell(page, "print('browser sees', mean_rain, len(rainfall_mm))")
    expect(output_with(page, "browser sees 18.0 4")).to_be_visible()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "lab-paired.png"))
    # One kernel: the notebook's own gateway session, which jlk ran in.
    assert len([s for s in gateway_sessions(gw) if s == f"notebook:{path}"]) == 1


def test_a_variable_defined_in_the_browser_is_read_back_with_jlk(gw, lab, page):
    from playwright.sync_api import expect

    path = agent_notebook(gw, "print('ready')")
    open_notebook(page, lab, path)
    run_new_cell(page, "from_browser = 'typed in lab'; print(len(from_browser))")
    expect(output_with(page, "12")).to_be_visible()
    listed = jlk(gw, "--session", f"notebook:{path}", "variables", "list").stdout
    assert re.search(r"^from_browser\s+str\s+length 12: 'typed in lab'$", listed, re.M), listed
    # And the agent's next cell of that notebook runs on it too.
    inserted = jlk(gw, "edit", "--path", path, "insert", "--source", "print(from_browser.upper())").stdout
    cell_id = re.search(r"inserted code cell (\S+) at index", inserted).group(1)
    assert jlk(gw, "execute", "--path", path, "--cell-id", cell_id).stdout.strip() == "TYPED IN LAB"


def wait_until_lab_has_saved(gw, path: str, quiet: float = 3.0) -> None:
    """Wait until JupyterLab's own save after opening (kernel metadata) is on disk: the file
    unchanged for ``quiet`` seconds, more than jupyter-collaboration's save delay plus its poll.

    An out-of-band change that lands while that save is pending can be overwritten by it:
    jupyter-collaboration reloads the file and saves the room's older content in the same
    moment (README, Live refresh).  This test is about the agent's change showing live, so it
    does not make its edit inside that window.
    """
    import time

    file = Path(gw.root) / "alice" / path
    last, since, deadline = file.stat().st_mtime_ns, time.monotonic(), time.monotonic() + 60
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.25)
        now = file.stat().st_mtime_ns
        if now != last:
            last, since = now, time.monotonic()


def test_an_agents_edit_and_run_appear_in_the_open_page(gw, lab, page):
    from playwright.sync_api import expect

    path = agent_notebook(gw, "original = 'before the agent edits'")
    open_notebook(page, lab, path)
    wait_until_lab_has_saved(gw, path)
    first_cell = page.locator(f"{PANEL} .jp-Notebook .jp-Cell").first
    expect(first_cell).to_contain_text("before the agent edits")
    jlk(gw, "edit", "--path", path, "replace-source", "--index", "0",
        "--source", "edited = 'by the agent'\nprint(edited)")
    expect(first_cell).to_contain_text("edited = 'by the agent'")
    jlk(gw, "execute", "--path", path, "--index", "0")
    expect(first_cell.locator(".jp-OutputArea-output")).to_contain_text("by the agent")
    # Live, not a reload: no "file changed on disk" dialog, and the page was never reloaded.
    expect(page.locator(".jp-Dialog")).to_have_count(0)


def test_interrupt_and_restart_from_the_toolbar(gw, lab, page):
    from playwright.sync_api import expect

    path = agent_notebook(gw, "survives = 'no'")
    jlk(gw, "execute", "--path", path, "--index", "0")
    kernel_id = gateway_sessions(gw)[f"notebook:{path}"]["kernel_id"]
    open_notebook(page, lab, path)
    indicator = page.locator(f"{PANEL} .jp-Notebook-ExecutionIndicator")
    run_new_cell(page, "import time\nfor _ in range(600): time.sleep(1)")
    expect(indicator).to_have_attribute("data-status", "busy")
    page.get_by_role("button", name="Interrupt the kernel").click()
    expect(output_with(page, "KeyboardInterrupt")).to_be_visible()
    expect(indicator).to_have_attribute("data-status", "idle")

    page.get_by_role("button", name="Restart the kernel", exact=True).click()
    dialog = page.locator(".jp-Dialog")
    expect(dialog).to_contain_text("Restart Kernel?")
    dialog.locator("button.jp-mod-accept").click()
    expect(page.locator(".jp-Dialog")).to_have_count(0)
    expect(indicator).to_have_attribute("data-status", "idle")
    run_new_cell(page, "print('after restart:', 'survives' in globals())")
    expect(output_with(page, "after restart: False")).to_be_visible()
    # The same kernel id, restarted: the agent's session sees the fresh kernel too.
    assert gateway_sessions(gw)[f"notebook:{path}"]["kernel_id"] == kernel_id
    listed = jlk(gw, "--session", f"notebook:{path}", "variables", "list").stdout
    assert "survives" not in listed


def test_the_file_browser_shows_the_agents_tree_and_nothing_else(gw, lab, page):
    from playwright.sync_api import expect

    root = gw.client.call("GET", "/v1/agents/alice")[1]["root"]
    page.goto(f"{lab.base}/lab/workspaces/t-{uuid.uuid4().hex[:8]}?token={lab.token}")
    listing = page.locator(".jp-FileBrowser .jp-DirListing-content .jp-DirListing-itemText")
    expect(listing.first).to_be_visible()
    expected = sorted(n for n in os.listdir(root) if not n.startswith("."))
    expect(listing).to_have_count(len(expected))
    shown = sorted(listing.all_inner_texts())
    assert shown == expected
    assert "state" not in shown and "bob" not in shown
    # The breadcrumbs start at the agent's root ("/"): no part of the host path above it shows.
    crumbs = page.locator(".jp-FileBrowser .jp-BreadCrumbs")
    expect(crumbs).to_be_visible()
    assert not {"agents", "alice", os.path.basename(os.path.dirname(root))} & set(crumbs.inner_text().split("/"))


def test_the_debugger_stops_at_a_breakpoint_in_the_sandboxed_kernel(gw, lab, page):
    from playwright.sync_api import expect

    path = agent_notebook(gw, "def double(n):\n    doubled = n * 2\n    return doubled\n\n"
                              "result = double(21)\nprint('result', result)")
    open_notebook(page, lab, path)
    toggle = page.locator(f"{PANEL} .jp-DebuggerBugButton")
    expect(toggle).to_be_enabled()  # the kernelspec and the kernel both say they can debug
    toggle.click()
    expect(toggle).to_have_attribute("aria-pressed", "true")
    cell = page.locator(f"{PANEL} .jp-Notebook .jp-Cell").first
    cell.click()
    # A breakpoint on line 2 (`doubled = n * 2`): the editor's breakpoint gutter.
    cell.locator(".cm-breakpoint-gutter .cm-gutterElement").nth(2).click()
    expect(cell.locator(".cm-breakpoint-gutter .cm-gutterElement").nth(2).locator(":scope > *")).to_have_count(1)
    page.keyboard.press("Shift+Enter")
    # Stopped there: the call stack names the function, and the variables of its frame show.
    callstack = page.locator(".jp-DebuggerCallstack")
    expect(callstack).to_contain_text("double")
    expect(page.locator(".jp-DebuggerVariables")).to_contain_text("21")  # n: 21
    page.screenshot(path=str(ARTIFACTS / "lab-debugger.png"))
    page.get_by_title(re.compile(r"^Continue")).first.click()
    expect(output_with(page, "result 42")).to_be_visible()


def test_jupyterlabs_log_shows_no_error_or_warning_after_the_browser_sessions(lab):
    """After every page above (notebooks the agent wrote opened, cells run, kernels restarted): no
    error, no warning, no traceback in Lab's log: not the kernelspec logo's "Could not open static
    file", not the websocket ping setting, not "Notebook ... is not trusted" on each load."""
    text = open(lab.log_path, errors="replace").read()
    flagged = [line for line in text.splitlines() if line.startswith(("[E ", "[W ", "[C ")) or "Traceback" in line]
    assert not flagged, "\n".join(flagged)

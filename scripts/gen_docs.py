#!/usr/bin/env python3
"""Regenerate the examples in README.md and SKILL.md by running them.

Each generated block sits between two markers, cog style::

    <!-- [[[gen NAME]]] -->
    ...
    <!-- [[[end]]] -->

and everything between them is produced here: a real gateway
(``kernel-gateway serve``) is started in a temporary directory, every command
shown is run through ``bash`` exactly as printed, and its output is written
back.  Volatile values are masked so that a rerun gives the same text: the
temporary directory reads ``/tmp/kgd``, and times, pids, durations, uuids and
the Python environment's path are replaced by ``<time>``, ``<pid>``, ``<ms>``,
``<uuid>`` and ``<venv>``.  An output cut short for the page says so with
``...``.

    .venv/bin/python scripts/gen_docs.py           # rewrite the blocks in place
    .venv/bin/python scripts/gen_docs.py --check   # exit 1 if a block is stale

``tests/test_docs.py`` runs the check.  README examples are run from a
checkout-like directory (``/tmp/kgd``) whose ``.venv/bin/jlk`` is this
checkout's ``jlk`` (one standard-library file, the same one an install copies);
SKILL.md examples are run as an agent runs them in its sandbox: ``jlk`` on
``PATH`` and the agent socket in ``$KERNEL_GATEWAY_SOCKET``.

The gateway is ``kernel-gateway serve --demo``, and its agent ``demo`` is
given nothing beyond what ``--demo`` gives it: SKILL.md's examples make the
files they use, so every one of them runs, in order, as written, for any
agent.  Only a job id cannot be written in advance: a command shows it as
``<job-1>`` (the first job the examples started), and it is run with the id.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from support import GatewayProcess, wait_until  # noqa: E402  (the tests' real gateway process)

JLK = REPO / "skills" / "jupyter-live-kernel" / "scripts" / "jlk"
FILES = {"README.md": REPO / "README.md", "SKILL.md": REPO / "skills" / "jupyter-live-kernel" / "SKILL.md"}
SHOWN_DIR = "/tmp/kgd"
MARKER = re.compile(r"<!-- \[\[\[gen ([a-z0-9-]+)\]\]\] -->\n(.*?)<!-- \[\[\[end\]\]\] -->", re.S)
REGENERATE = ".venv/bin/python scripts/gen_docs.py"


# --- what is shown --------------------------------------------------------------------


@dataclass
class Step:
    """One command as printed; ``head``/``tail`` keep that many output lines around a `...`."""

    command: str  # `<job-N>` stands for the id of the N-th job the examples started
    head: int | None = None
    tail: int = 0
    expect: int = 0  # its exit code; anything else fails the generation


@dataclass
class Block:
    file: str
    steps: list[Step]
    fence: str = "console"
    session: str | None = None  # SKILL blocks: $JLK_SESSION of the agent typing them
    setup: list[str] = field(default_factory=list)  # run first on the control socket, not shown
    capture: object = None  # instead of steps: a function of the Run giving the text to show


@dataclass
class Run:
    """A gateway in a temporary directory and how to run shown commands against it."""

    base: Path
    gateway: GatewayProcess | None = None
    env: dict = field(default_factory=dict)
    cell_ids: dict = field(default_factory=dict)  # random cell id -> its stable stand-in
    job_ids: dict = field(default_factory=dict)  # random job id -> its stable stand-in


def banner(run: Run) -> str:
    """What ``kernel-gateway serve --demo`` printed when it started (the quick start's sample)."""
    lines = Path(run.gateway.log).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if " listening on " in line)
    shown = [lines[start]]
    for line in lines[start + 1:]:
        if not (line.startswith("  ") or line.startswith("Try, in another terminal")):
            break
        shown.append(line)
    return "\n".join(shown) + "\n"


def readme_blocks() -> dict[str, Block]:
    curl = "curl -s --unix-socket var/state/control.sock"
    jlk = ".venv/bin/jlk --socket var/state/control.sock --agent alice --session main"
    return {
        "readme-banner": Block("README.md", [], fence="", capture=banner),
        "readme-session": Block("README.md", [
            Step(f"{curl} -X PUT http://kg/v1/agents/alice"),
            Step(f"{curl} -X POST http://kg/v1/agents/alice/sessions/main/execute "
                 """-d '{"code": "x = 41\\nprint(\\"hello\\")\\nx + 1"}'"""),
            Step(f"{curl} http://kg/v1/agents/alice/sessions"),
            Step(f"""{curl} -X POST http://kg/v1/agents/alice/commands -d '{{"command": "id; pwd", "session": "main"}}'"""),
            Step(f"""{curl} -X POST http://kg/v1/agents/alice/sessions/main/execute -d '{{"code": 7}}'"""),
            Step(f"""{jlk} execute --code "x * 2\""""),
            Step(f"{jlk} variables list"),
            Step(f"""{jlk} sh 'echo "$JLK_SESSION in $PWD"'"""),
        ], fence=""),
        "readme-error": Block("README.md", [
            Step(f"""{jlk} execute --code $'def f():\\n    return 1/0\\nf()'""", expect=1),
        ], fence=""),
    }


MAKE_WEATHER = (
    """jlk execute --code $'import os, numpy as np, pandas as pd\\n"""
    """rng = np.random.default_rng(7)\\n"""
    """df = pd.DataFrame({"city": rng.choice(["Lima", "Oslo", "Pune"], 200),\\n"""
    """                   "temp": rng.uniform(2, 28, 200).round(1), "rain_mm": rng.uniform(0, 12, 200).round(1)})\\n"""
    """df.to_csv(os.environ["KERNEL_GATEWAY_AGENT_ROOT"] + "/user-files/weather.csv", index=False)\\n"""
    """print(df.shape)\\ndf.head(3)'"""
)

ADD_NOTES = """jlk patch <<'EOF'
*** Begin Patch
*** Add File: user-files/notes.md
+# Notes
+rain is measured in inches
*** End Patch
EOF"""

FIX_NOTES = """jlk patch <<'EOF'
*** Begin Patch
*** Update File: user-files/notes.md
@@
 # Notes
-rain is measured in inches
+rain is measured in mm
*** End Patch
EOF"""

# Made with `jlk sh`, so they are the agent's own files, as a job's apply needs.
WRITE_CALC = """jlk sh --cwd user-files/calc 'cat > calc.py' <<'EOF'
def add(a, b):
    return a - b
EOF"""

WRITE_TEST = """jlk sh --cwd user-files/calc 'cat > test_calc.py' <<'EOF'
from calc import add
assert add(2, 3) == 5, f"add(2, 3) is {add(2, 3)}"
print("ok")
EOF"""


def skill_blocks() -> dict[str, Block]:
    """SKILL.md's examples, in the order the file shows them (each may use what the ones before made)."""
    return {
        "skill-core-loop": Block("SKILL.md", [
            Step(MAKE_WEATHER),
            Step("""jlk execute --code 'df.groupby("city")["temp"].mean().round(2)'"""),
        ]),
        "skill-variables": Block("SKILL.md", [
            Step("jlk variables list"),
            Step("jlk variables preview --name df", head=12),
        ]),
        "skill-errors": Block("SKILL.md", [
            Step("jlk execute --code 'ratio = total_rain / days'", expect=1),
            Step("""jlk execute --code 'df.groupby("city")["temp"].mean(.round(2)'""", expect=1),
        ]),
        "skill-files": Block("SKILL.md", [
            Step(ADD_NOTES),
            Step("jlk sh 'pwd; ls $KERNEL_GATEWAY_AGENT_ROOT/user-files'"),
            Step("jlk read --path user-files/weather.csv --limit 3"),
            Step("jlk sh 'grep -c Oslo $KERNEL_GATEWAY_AGENT_ROOT/user-files/weather.csv; exit 3'; echo exit=$?"),
            Step("""printf 'Oslo\\nLima\\nOslo\\n' | jlk sh 'sort | uniq -c'"""),
            Step(FIX_NOTES),
        ]),
        "skill-notebooks": Block("SKILL.md", [
            Step("jlk new --path user-files/weather.ipynb"),
            Step("jlk edit --path user-files/weather.ipynb insert --cell-type markdown --source '# Weather by city'"),
            Step("""jlk edit --path user-files/weather.ipynb insert --source $'import os, pandas as pd\\n"""
                 """df = pd.read_csv(os.environ["KERNEL_GATEWAY_AGENT_ROOT"] + "/user-files/weather.csv")'"""),
            Step("""jlk edit --path user-files/weather.ipynb insert --source 'df.groupby("city")["rain_mm"].sum()'"""),
            Step("jlk contents --path user-files/weather.ipynb"),
        ]),
        "skill-notebook-edit": Block("SKILL.md", [
            Step("""jlk edit --path user-files/weather.ipynb replace-source --index 2 """
                 """--source 'df.groupby("city")["rain_mm"].sum().round(1)'"""),
            Step("jlk execute --path user-files/weather.ipynb --index 1"),
            Step("jlk execute --path user-files/weather.ipynb --index 2"),
            Step("jlk contents --path user-files/weather.ipynb --include-outputs", head=16),
        ]),
        "skill-verify": Block("SKILL.md", [
            Step("""jlk edit --path user-files/weather.ipynb insert --source 'df["temperature"].describe()'"""),
            Step("jlk run-all --path user-files/weather.ipynb", expect=1),
            Step("""jlk edit --path user-files/weather.ipynb replace-source --index 3 --source 'df["temp"].describe().round(1)'"""),
            Step("jlk restart-run-all --path user-files/weather.ipynb --save-outputs"),
        ]),
        "skill-images": Block("SKILL.md", [
            Step("""jlk execute --code $'import matplotlib.pyplot as plt\\ndf.boxplot(column="temp", by="city")\\nplt.show()'"""),
        ]),
        "skill-large-output": Block("SKILL.md", [
            Step("jlk execute --code 'for i in range(200000): print(i)'", head=3, tail=4),
        ]),
        "skill-timeout": Block("SKILL.md", [
            Step("jlk execute --timeout 2 --code $'import time\\ntime.sleep(60)'", expect=124),
        ]),
        "skill-skills": Block("SKILL.md", [
            Step("jlk skills"),
        ]),
        # It turns the live kernel off for the agent: every kernel example comes before it.
        "skill-disabled": Block("SKILL.md", [
            Step("jlk execute --code 1; echo exit=$?"),
        ], setup=["""curl -s --unix-socket var/state/control.sock -X PATCH """
                  """http://kg/v1/agents/demo/skills/jupyter-live-kernel -d '{"enabled": false}'"""]),
        "skill-jobs": Block("SKILL.md", [
            Step("jlk sh --cwd user-files 'mkdir calc'"),
            Step(WRITE_CALC),
            Step(WRITE_TEST),
            Step("""jlk job run --from user-files/calc --command 'sed -i "s/a - b/a + b/" calc.py && python3 test_calc.py' --wait"""),
            Step("jlk job apply <job-1>"),
        ]),
    }


def all_blocks() -> dict[str, Block]:
    return {**readme_blocks(), **skill_blocks()}


# --- running --------------------------------------------------------------------------


def start(base: Path) -> Run:
    """``kernel-gateway serve --demo`` with its tree in ``base/var`` (the embedded defaults' layout)."""
    run = Run(base)
    (base / ".venv" / "bin").mkdir(parents=True)
    os.symlink(JLK, base / ".venv" / "bin" / "jlk")
    (base / "var").mkdir()
    run.gateway = GatewayProcess(base / "var", "--demo", "--Gateway.spare_kernels=False").start()
    run.env = {"PATH": f"{base / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
               "HOME": str(base)}
    # --demo makes the agent as the gateway starts; its socket is bound once it is registered.
    demo_socket = base / "var" / "state" / "agents" / "demo.sock"
    if not wait_until(demo_socket.exists, timeout=60):
        raise RuntimeError("serve --demo made no agent 'demo'")
    (base / "work").mkdir()
    return run


def stop(run: Run) -> None:
    if run.gateway is not None:
        run.gateway.stop()


def shell(run: Run, command: str, cwd: Path, env: dict) -> tuple[int, str]:
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    return done.returncode, done.stdout


def agent_env(run: Run, block: Block) -> dict:
    env = dict(run.env, KERNEL_GATEWAY_SOCKET=str(run.base / "var" / "state" / "agents" / "demo.sock"),
               KERNEL_GATEWAY_AGENT="demo")
    if block.session:
        env["JLK_SESSION"] = block.session
    return env


# --- masking ----------------------------------------------------------------------------


SHA256 = re.compile(r"\bsha256 [0-9a-f]{64}\b")
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
ISO_TIME = re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:?\d\d)?\b")
JSON_NUMBER = re.compile(r'"([A-Za-z_]+)": (-?\d+(?:\.\d+)?)')
SITE_PACKAGES = re.compile(r"\S*/lib/python3\.\d+/site-packages/")


NEW_CELL = re.compile(r"inserted \w+ cell ([0-9a-f]{8}) at index")
NEW_JOB = re.compile(r"^job ([0-9a-f]{12}) ", re.M)
JOB_PLACEHOLDER = re.compile(r"<job-(\d+)>")


LOOPBACK_PORT = re.compile(r"\b127\.0\.0\.1:\d+")


def mask(text: str, run: Run) -> str:
    text = text.replace(str(run.base), SHOWN_DIR)
    text = text.replace(str(REPO), SHOWN_DIR)  # the checkout: its .venv is the one shown in /tmp/kgd
    text = LOOPBACK_PORT.sub("127.0.0.1:<port>", text)
    # New cells get random ids: each is shown as <id-N>, N counting from the first one made.
    for cell_id in NEW_CELL.findall(text):
        run.cell_ids.setdefault(cell_id, f"<id-{len(run.cell_ids) + 1}>")
    for cell_id, shown in run.cell_ids.items():
        text = text.replace(cell_id, shown)
    for job_id in NEW_JOB.findall(text):
        run.job_ids.setdefault(job_id, f"<job-{len(run.job_ids) + 1}>")
    for job_id, shown in run.job_ids.items():
        text = text.replace(job_id, shown)
    text = SITE_PACKAGES.sub("<venv>/site-packages/", text)
    text = UUID.sub("<uuid>", text)
    text = SHA256.sub("sha256 <sha256>", text)  # a job's patch carries its files' times
    text = ISO_TIME.sub("<time>", text)

    def number(match: re.Match) -> str:
        key, value = match.group(1), match.group(2)
        if key == "pid" or key.endswith("_pid"):
            return f'"{key}": <pid>'
        if key.endswith("_ms") or key.endswith("_s") or key == "duration":
            return f'"{key}": <ms>' if key.endswith("_ms") else f'"{key}": <s>'
        if float(value) > 1e9:  # a Unix time
            return f'"{key}": <time>'
        return match.group(0)

    return JSON_NUMBER.sub(number, text)


def shorten(output: str, step: Step) -> str:
    """The first ``head`` and last ``tail`` lines, with `...` for the rest; a cut marker in between stays."""
    lines = output.rstrip("\n").split("\n")
    if step.head is not None and len(lines) > step.head + step.tail + 1:
        middle = lines[step.head: len(lines) - step.tail]
        markers = [line for line in middle if line.startswith("[... ")]
        kept = ["..."] + (markers + ["..."] if markers and step.tail else markers)
        lines = lines[: step.head] + kept + (lines[-step.tail:] if step.tail else [])
    return "\n".join(lines)


def render(name: str, block: Block, run: Run) -> str:
    if block.capture is not None:
        return f"```{block.fence}\n{mask(block.capture(run), run).rstrip()}\n```\n"
    for command in block.setup:
        code, output = shell(run, command, run.base, run.env)
        if code != 0:
            raise RuntimeError(f"block {name}: setup `{command}` exited {code}:\n{output}")
    parts = []
    for step in block.steps:
        ids = {shown: job_id for job_id, shown in run.job_ids.items()}
        command = JOB_PLACEHOLDER.sub(lambda m: ids.get(m.group(0), m.group(0)), step.command)
        if block.file == "README.md":
            code, output = shell(run, command, run.base, run.env)
        else:
            code, output = shell(run, command, run.base / "work", agent_env(run, block))
        if code != step.expect:
            raise RuntimeError(f"block {name}: `{step.command}` exited {code}, expected {step.expect}:\n{output}")
        shown = shorten(mask(output, run), step)
        parts.append(f"$ {step.command}" + (f"\n{shown}" if shown else ""))
    body = ("\n\n" if block.file == "README.md" else "\n").join(parts)
    return f"```{block.fence}\n{body}\n```\n"


def generate(names: list[str] | None = None) -> dict[str, str]:
    """Run the examples; return each block's new text, by name."""
    blocks = all_blocks()
    base = Path(tempfile.mkdtemp(prefix="kg-docs-"))
    run = start(base)
    try:
        return {name: render(name, block, run) for name, block in blocks.items() if not names or name in names}
    finally:
        stop(run)
        shutil.rmtree(base, ignore_errors=True)


# --- the files --------------------------------------------------------------------------


def blocks_in(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in MARKER.finditer(text)}


def rewrite(text: str, generated: dict[str, str]) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        new = generated.get(name, match.group(2))
        return f"<!-- [[[gen {name}]]] -->\n{new}<!-- [[[end]]] -->"

    return MARKER.sub(replace, text)


def stale_blocks(generated: dict[str, str]) -> list[str]:
    """A unified diff per block whose checked-in text differs from ``generated``."""
    problems = []
    for label, path in FILES.items():
        present = blocks_in(path.read_text())
        for name, block in all_blocks().items():
            if block.file != label:
                continue
            if name not in present:
                problems.append(f"{label}: the block {name!r} is missing (add its markers)")
            elif present[name] != generated[name]:
                diff = difflib.unified_diff(present[name].splitlines(), generated[name].splitlines(),
                                            f"{label} [{name}] checked in", f"{label} [{name}] generated", lineterm="")
                problems.append("\n".join(diff))
    return problems


def main(argv: list[str]) -> int:
    check = "--check" in argv
    generated = generate()
    if check:
        problems = stale_blocks(generated)
        if problems:
            print("\n\n".join(problems))
            print(f"\nthe generated examples are out of date: run `{REGENERATE}` and commit the result")
            return 1
        print("the generated examples are up to date")
        return 0
    for label, path in FILES.items():
        text = path.read_text()
        new = rewrite(text, generated)
        if new != text:
            path.write_text(new)
            print(f"rewrote {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

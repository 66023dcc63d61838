"""The documented examples are what the code does.

README.md and SKILL.md carry generated blocks (``scripts/gen_docs.py`` runs
their commands against a real gateway); here they are generated again, in
memory, and compared with what is checked in.  The examples in ``jlk --help``
are run too, as an agent would type them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
gen_docs = importlib.util.module_from_spec(spec)
sys.modules["gen_docs"] = gen_docs  # its dataclasses look their module up
spec.loader.exec_module(gen_docs)


def test_the_generated_examples_in_readme_and_skill_are_up_to_date():
    problems = gen_docs.stale_blocks(gen_docs.generate())
    assert not problems, (
        "\n\n".join(problems)
        + f"\n\nthe generated examples are out of date: run `{gen_docs.REGENERATE}` and commit the result"
    )


def test_a_stale_block_is_reported_with_the_command_to_run(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- [[[gen readme-error]]] -->\n```\nold\n```\n<!-- [[[end]]] -->\nrest\n")
    monkeypatch.setattr(gen_docs, "FILES", {"README.md": readme})
    generated = {"readme-error": "```\nnew\n```\n", "readme-session": "```\n```\n"}
    problems = gen_docs.stale_blocks(generated)
    assert any("-old" in p and "+new" in p for p in problems)
    assert any("'readme-session' is missing" in p for p in problems)
    # Rewriting touches the block only.
    assert gen_docs.rewrite(readme.read_text(), generated) == (
        "intro\n<!-- [[[gen readme-error]]] -->\n```\nnew\n```\n<!-- [[[end]]] -->\nrest\n"
    )


def test_masking_hides_what_changes_between_runs(tmp_path):
    run = gen_docs.Run(tmp_path)
    text = (f'{{"created": 1796034507.15, "pid": 3459, "duration_ms": 64.06, "execution_count": 2, '
            f'"kernel_id": "0f8fad5b-d9cb-469f-a165-70867728950e", "cwd": "{tmp_path}/var/agents/a"}}\n'
            "inserted code cell 3f2a9c1e at index 0\ncell 3f2a9c1e [1]: ok\n"
            "File /opt/x/.venv/lib/python3.12/site-packages/pandas/frame.py:1")
    assert gen_docs.mask(text, run) == (
        '{"created": <time>, "pid": <pid>, "duration_ms": <ms>, "execution_count": 2, '
        '"kernel_id": "<uuid>", "cwd": "/tmp/kgd/var/agents/a"}\n'
        "inserted code cell <id-1> at index 0\ncell <id-1> [1]: ok\n"
        "File <venv>/site-packages/pandas/frame.py:1"
    )


@pytest.fixture(scope="module")
def docs_gateway():
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="kg-help-"))
    run = gen_docs.start(base)
    try:
        yield run
    finally:
        gen_docs.stop(run)
        shutil.rmtree(base, ignore_errors=True)


def help_examples() -> list[str]:
    text = subprocess.run([sys.executable, str(gen_docs.JLK), "--help"], capture_output=True, text=True).stdout
    block = text.split("\nexamples:\n", 1)[1].split("\n\n", 1)[0]
    return [line.strip() for line in block.splitlines()]


def test_every_example_in_jlk_help_works_as_written(docs_gateway):
    examples = help_examples()
    assert len(examples) >= 8 and all(line.startswith("jlk ") for line in examples)
    run = docs_gateway
    root = run.base / "var" / "agents" / "demo"
    (root / "user-files" / "data.csv").write_text("a,b\n1,2\n3,4\n")
    (run.base / "work" / "change.patch").write_text(
        "*** Begin Patch\n*** Add File: user-files/hello.txt\n+hello\n*** End Patch\n")
    block = gen_docs.Block("SKILL.md", [], session="help-examples")
    for line in examples:
        code, output = gen_docs.shell(run, line, run.base / "work", gen_docs.agent_env(run, block))
        assert code == 0, f"`{line}` exited {code}:\n{output}"
    assert (root / "user-files" / "hello.txt").read_text() == "hello\n"


def test_every_example_in_skill_md_is_generated_in_the_order_it_is_shown():
    """SKILL.md's examples are run, in order, against ``serve --demo``: none is only typed in."""
    text = gen_docs.FILES["SKILL.md"].read_text()
    outside = gen_docs.MARKER.sub("", text)
    assert "\n$ " not in outside and "```console" not in outside, "an example in SKILL.md that no run produced"
    shown = [m.group(1) for m in gen_docs.MARKER.finditer(text)]
    assert shown == list(gen_docs.skill_blocks()), "generate SKILL.md's blocks in the order the file shows them"


def test_skill_md_examples_run_against_serve_demo_with_nothing_seeded():
    import inspect
    source = inspect.getsource(gen_docs.start)
    assert '"--demo"' in source
    # The examples make their own data: the demo agent's user-files starts empty.
    assert "write_text" not in source and "user-files" not in source


def test_the_quick_starts_sample_banner_is_the_one_serve_demo_prints():
    readme = gen_docs.FILES["README.md"].read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "<!-- [[[gen readme-banner]]] -->" in quick_start  # generated, so it cannot drift from the real one
    assert gen_docs.all_blocks()["readme-banner"].capture is gen_docs.banner

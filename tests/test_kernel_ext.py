"""kernel_gateway.kernel_ext in a real ipykernel, started through plain jupyter_client.

Kernels run from the default ``python3`` kernelspec of this virtualenv, with the
extension loaded from the command line.  ``PYTEST_CURRENT_TEST`` is kept out
of their environment: ipykernel skips its fd-level capture when it sees it.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
from jupyter_client import KernelManager

LIMIT = 40000  # not the default, so the test shows the variable is read
EXTENSION_ARG = "--IPKernelApp.extensions=['kernel_gateway.kernel_ext']"
# IPython's history thread writes its sqlite file on its own schedule; in memory it
# cannot run into the file-size limit a test lowers, nor print about it mid-cell.
HISTORY_IN_MEMORY = "--HistoryManager.hist_file=:memory:"
TRUNCATION = "application/vnd.kernel-gateway.truncation+json"
ARTIFACT = "application/vnd.kernel-gateway.artifact+json"
# The marker with the longest path a test here produces, plus JSON framing.
MARKER_ALLOWANCE = 400


@dataclass
class Cell:
    """Everything one execute request produced."""

    reply: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return self.reply["execution_count"]

    def of_type(self, *kinds: str) -> list[dict[str, Any]]:
        return [m["content"] for m in self.messages if m["msg_type"] in kinds]

    def stream(self, name: str = "stdout") -> str:
        return "".join(c["text"] for c in self.of_type("stream") if c["name"] == name)

    def announcements(self) -> list[dict[str, Any]]:
        return [c["data"][TRUNCATION] for c in self.of_type("display_data") if TRUNCATION in c["data"]]

    def largest_message(self) -> int:
        """Bytes of the largest payload: stream text, or the JSON of the rest."""
        return max(
            len(m["content"]["text"].encode()) if m["msg_type"] == "stream" else len(json.dumps(m["content"]))
            for m in self.messages
        )


class Kernel:
    def __init__(self, km: KernelManager):
        self.km = km
        self.kc = km.client()

    def run(self, code: str, timeout: float = 60, **options: Any) -> Cell:
        msg_id = self.kc.execute(code, allow_stdin=False, **options)
        messages = []
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no idle status within {timeout}s for {code!r}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status":
                if msg["content"]["execution_state"] == "idle":
                    break
                continue
            messages.append(msg)
        while True:
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                return Cell(reply["content"], messages)


def kernel_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["MPLBACKEND"] = "Agg"
    env.update(extra)
    return env


@contextmanager
def started_kernel(cwd: Path, extension: bool = True, stderr_path: Path | None = None, **env: str) -> Iterator[Kernel]:
    km = KernelManager(kernel_name="python3")
    stderr = open(stderr_path, "w") if stderr_path else subprocess.DEVNULL
    try:
        # fd-level output is also echoed to the kernel's own stdout: drop it.
        km.start_kernel(
            cwd=str(cwd),
            env=kernel_env(**env),
            extra_arguments=[HISTORY_IN_MEMORY] + ([EXTENSION_ARG] if extension else []),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    finally:
        if stderr_path:
            stderr.close()
    kernel = Kernel(km)
    kernel.kc.start_channels()
    try:
        kernel.kc.wait_for_ready(timeout=30)
        yield kernel
    finally:
        kernel.kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="module")
def kernel(session_dir: Path) -> Iterator[Kernel]:
    with started_kernel(session_dir, KERNEL_GATEWAY_OUTPUT_LIMIT=str(LIMIT)) as kernel:
        yield kernel


def assert_stream_cut(cell: Cell, spill: Path, total: int) -> str:
    """The client got head, marker, tail and a footer naming the file; the spill file has it all."""
    text = cell.stream()
    marker = f"\n[... {total - LIMIT} bytes cut: full output in {spill} ...]\n"
    footer = f"[output cut: {total - LIMIT} of {total} bytes not shown; full output in {spill}]\n"
    assert marker in text
    assert text.endswith("\n" + footer)  # the last line says where the rest is, for a reader of the end only
    ends_line = spill.read_bytes()[-1:] == b"\n"  # if not, a newline puts the footer on a line of its own
    assert len(text.encode()) == LIMIT + len(marker) + len(footer) + (0 if ends_line else 1)
    assert cell.largest_message() <= LIMIT // 2 + MARKER_ALLOWANCE
    assert spill.stat().st_size == total
    assert cell.announcements() == [
        {"kind": "stream", "name": "stdout", "cut_bytes": total - LIMIT, "total_bytes": total, "path": str(spill)}
    ]
    return text[: len(text) - len(footer) - (0 if ends_line else 1)]  # head, marker and tail, as the callers check them


def test_one_100mb_print_is_cut_at_the_source(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run("print('x' * 100_000_000)")

    assert cell.reply["status"] == "ok"
    spill = session_dir / "outputs" / f"cell-{cell.count}-stdout.txt"
    text = assert_stream_cut(cell, spill, 100_000_001)
    assert text.startswith("x" * (LIMIT // 2) + "\n[...")
    assert text.endswith("...]\n" + "x" * (LIMIT // 2 - 1) + "\n")
    with open(spill, "rb") as spilled:
        assert spilled.read(10) == b"x" * 10
        spilled.seek(-2, os.SEEK_END)
        assert spilled.read() == b"x\n"


def test_100mb_in_many_prints_is_cut_and_spilled_in_order(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run("for i in range(100_000): print(f'{i:07d}', '.' * 991)")

    spill = session_dir / "outputs" / f"cell-{cell.count}-stdout.txt"
    text = assert_stream_cut(cell, spill, 100_000_000)
    assert text.startswith("0000000 " + "." * 991 + "\n")
    assert text.endswith("\n0099999 " + "." * 991 + "\n")
    with open(spill) as spilled:
        for expected, line in enumerate(spilled):
            assert line == f"{expected:07d} {'.' * 991}\n"
    assert expected == 99_999


def test_fd_level_output_is_bounded_too(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run("import os; os.write(1, b'z' * 3_000_000);")

    spill = session_dir / "outputs" / f"cell-{cell.count}-stdout.txt"
    assert_stream_cut(cell, spill, 3_000_000)


def test_ipython_history_does_not_keep_the_stream(kernel: Kernel) -> None:
    kernel.run("print('h' * 10_000_000)")
    cell = kernel.run(
        "outputs = get_ipython().history_manager.outputs\n"
        "print(sum(len(part) for out in outputs.values() for o in out for part in o.bundle.get('stream', [])))"
    )

    assert int(cell.stream()) <= LIMIT + MARKER_ALLOWANCE


def test_the_next_cell_starts_fresh(kernel: Kernel, session_dir: Path) -> None:
    big = kernel.run("print('b' * 1_000_000)")
    small = kernel.run("print('after')")
    big_again = kernel.run("print('c' * 1_000_000)")

    assert big.announcements()[0]["path"] == str(session_dir / "outputs" / f"cell-{big.count}-stdout.txt")
    assert small.stream() == "after\n"
    assert small.announcements() == []
    assert_stream_cut(big_again, session_dir / "outputs" / f"cell-{big_again.count}-stdout.txt", 1_000_001)


def test_output_between_half_and_the_limit_arrives_whole(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run("print('m' * 30_000)")

    assert cell.stream() == "m" * 30_000 + "\n"
    assert cell.announcements() == []
    assert not (session_dir / "outputs" / f"cell-{cell.count}-stdout.txt").exists()


def test_cells_sharing_an_execution_count_get_their_own_files(kernel: Kernel, session_dir: Path) -> None:
    first = kernel.run("print('1' * 100_000)", store_history=False)
    second = kernel.run("print('2' * 100_000)", store_history=False)

    assert first.count == second.count
    first_path, second_path = first.announcements()[0]["path"], second.announcements()[0]["path"]
    assert first_path == str(session_dir / "outputs" / f"cell-{first.count}-stdout.txt")
    assert second_path == str(session_dir / "outputs" / f"cell-{first.count}-stdout-2.txt")
    assert Path(first_path).read_text() == "1" * 100_000 + "\n"
    assert Path(second_path).read_text() == "2" * 100_000 + "\n"


def test_a_forked_child_is_bounded_and_says_where_the_rest_went(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run(
        "import multiprocessing\n"
        "child = multiprocessing.get_context('fork').Process(target=lambda: print('k' * 1_000_000))\n"
        "child.start(); child.join(); print('parent done')"
    )

    spill = session_dir / "outputs" / f"cell-{cell.count}-stdout.txt"
    text = cell.stream()
    assert text.startswith("k" * (LIMIT // 2) + "\n[... output of process ")
    assert f" beyond {LIMIT // 2} bytes in {spill} ...]\n" in text
    assert text.endswith("parent done\n")
    assert len(text.encode()) < LIMIT // 2 + MARKER_ALLOWANCE
    assert spill.read_text() == "k" * 1_000_000 + "\n"


def test_stderr_is_bounded_separately(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run("import sys; print('out'); sys.stderr.write('e' * 200_000)")

    assert cell.stream("stdout") == "out\n"
    spill = session_dir / "outputs" / f"cell-{cell.count}-stderr.txt"
    assert f"bytes cut: full output in {spill}" in cell.stream("stderr")
    assert len(cell.stream("stderr").encode()) < LIMIT + MARKER_ALLOWANCE
    assert [a["name"] for a in cell.announcements()] == ["stderr"]
    assert spill.read_text() == "e" * 200_000


def test_multibyte_text_is_never_split(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run("print('é€😀' * 100_000)")

    text = cell.stream()
    head, _, tail = text.partition("\n[... ")
    assert set(head) <= set("é€😀") and head
    assert set(tail.split("...]\n", 1)[1].split("\n[output cut: ")[0]) <= set("é€😀\n")
    spill = Path(cell.announcements()[0]["path"])
    assert spill.read_text(encoding="utf-8") == "é€😀" * 100_000 + "\n"


def test_a_spill_file_that_cannot_grow_is_dropped_not_promised(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run(
        "import resource\n"
        "_soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, _hard))\n"
        "try:\n"
        "    print('f' * 1_000_000)\n"
        "finally:\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (_soft, _hard))"
    )

    assert cell.reply["status"] == "ok"
    text = cell.stream()
    assert text == "f" * (LIMIT // 2) + f"\n[... {1_000_001 - LIMIT} bytes cut: full output could not be saved ...]\n" + "f" * (LIMIT // 2 - 1) + "\n" + (
        f"[output cut: {1_000_001 - LIMIT} of 1000001 bytes not shown; the full output could not be saved]\n")
    assert cell.announcements()[0]["path"] is None
    assert not (session_dir / "outputs" / f"cell-{cell.count}-stdout.txt").exists()


def test_huge_execute_result_is_cut_and_spilled(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run("'y' * 10_000_000")

    [result] = cell.of_type("execute_result")
    text = result["data"]["text/plain"]
    spill = session_dir / "outputs" / f"cell-{cell.count}-out-1.txt"
    total = 10_000_002  # the repr has quotes
    assert text == "'" + "y" * (LIMIT // 2 - 1) + f"\n[... {total - LIMIT} bytes cut: full output in {spill} ...]\n" + "y" * (LIMIT // 2 - 1) + "'" + (
        f"\n[output cut: {total - LIMIT} of {total} bytes not shown; full output in {spill}]")
    assert spill.read_text() == "'" + "y" * 10_000_000 + "'"
    assert cell.announcements() == [
        {"kind": "result", "name": "text/plain", "cut_bytes": total - LIMIT, "total_bytes": total, "path": str(spill)}
    ]
    assert cell.largest_message() <= LIMIT + MARKER_ALLOWANCE


def test_matplotlib_figure_becomes_a_png_artifact(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run("%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);")

    [figure] = [c for c in cell.of_type("display_data") if ARTIFACT in c["data"]]
    assert "image/png" not in figure["data"]
    assert figure["data"]["text/plain"].startswith("<Figure size")
    reference = figure["data"][ARTIFACT]
    png = Path(reference["path"])
    assert png == session_dir / "outputs" / f"cell-{cell.count}-1.png"
    assert reference["mime"] == "image/png"
    assert reference["size"] == png.stat().st_size
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert cell.largest_message() < 1000


def test_every_binary_of_a_bundle_becomes_an_artifact(kernel: Kernel, session_dir: Path) -> None:
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
    pdf = b"%PDF-1.4\n" + bytes(range(256))
    cell = kernel.run(
        "from IPython.display import publish_display_data\n"
        f"publish_display_data({{'image/png': {base64.b64encode(png).decode()!r},"
        f" 'application/pdf': {base64.b64encode(pdf).decode()!r}, 'text/plain': 'two'}})"
    )

    [bundle] = cell.of_type("display_data")
    outputs = session_dir / "outputs"
    assert bundle["data"] == {
        "text/plain": "two",
        ARTIFACT: {
            "mime": "image/png",
            "path": str(outputs / f"cell-{cell.count}-1.png"),
            "size": len(png),
            "more": [{"mime": "application/pdf", "path": str(outputs / f"cell-{cell.count}-2.pdf"), "size": len(pdf)}],
        },
    }
    assert (outputs / f"cell-{cell.count}-1.png").read_bytes() == png
    assert (outputs / f"cell-{cell.count}-2.pdf").read_bytes() == pdf


def test_large_html_is_cut_and_large_svg_and_json_become_artifacts(kernel: Kernel, session_dir: Path) -> None:
    cell = kernel.run(
        "from IPython.display import display, HTML, SVG, JSON\n"
        "display(HTML('<p>' + 'h' * 100_000 + '</p>'))\n"
        "display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\">' + '<g/>' * 30_000 + '</svg>'))\n"
        "display(JSON({'rows': list(range(30_000))}))"
    )

    outputs = session_dir / "outputs"
    html, svg, data = [c["data"] for c in cell.of_type("display_data") if TRUNCATION not in c["data"]]
    html_spill = outputs / f"cell-{cell.count}-out-1.html"
    assert f"bytes cut: full output in {html_spill}" in html["text/html"]
    assert html_spill.read_text() == "<p>" + "h" * 100_000 + "</p>"
    assert cell.announcements()[0]["name"] == "text/html"

    assert "image/svg+xml" not in svg
    assert svg[ARTIFACT]["mime"] == "image/svg+xml"
    assert Path(svg[ARTIFACT]["path"]).read_text().endswith("<g/></svg>")

    assert "application/json" not in data
    assert json.loads(Path(data[ARTIFACT]["path"]).read_text()) == {"rows": list(range(30_000))}


SMALL_OUTPUTS = """\
import sys
from IPython.display import display, HTML, Markdown, JSON
print('hello', 'wörld')
sys.stderr.write('a warning\\n')
display(HTML('<b>bold</b>'), Markdown('*md*'), JSON({'a': [1, 2]}))
{'answer': 42, 'text': 'x' * 1000}
"""


def test_small_outputs_are_byte_identical_to_a_plain_kernel(kernel: Kernel, tmp_path: Path) -> None:
    bounded = kernel.run(SMALL_OUTPUTS)
    with started_kernel(tmp_path, extension=False) as plain_kernel:
        plain = plain_kernel.run(SMALL_OUTPUTS)

    def outputs(cell: Cell) -> list[str]:
        return [
            json.dumps([m["msg_type"], {k: v for k, v in m["content"].items() if k != "execution_count"}])
            for m in cell.messages
            if m["msg_type"] != "execute_input"
        ]

    assert outputs(bounded) == outputs(plain)
    assert len(outputs(plain)) == 6
    assert not (tmp_path / "outputs").exists()


def test_input_fails_fast_without_stdin(kernel: Kernel) -> None:
    cell = kernel.run("input('name? ')", timeout=10)

    assert cell.reply["status"] == "error"
    assert cell.reply["ename"] == "StdinNotImplementedError"


def test_bad_settings_leave_a_working_kernel(tmp_path: Path) -> None:
    """A bad limit falls back to the default; an unusable output dir still bounds, saying so."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    stderr_path = tmp_path / "kernel-stderr.txt"
    with started_kernel(
        tmp_path,
        stderr_path=stderr_path,
        KERNEL_GATEWAY_OUTPUT_LIMIT="lots",
        KERNEL_GATEWAY_OUTPUT_DIR=str(not_a_dir / "outputs"),
    ) as kernel:
        cell = kernel.run("print('q' * 1_000_000)")
        after = kernel.run("print('still here')")

    assert cell.reply["status"] == "ok"
    text = cell.stream()
    assert text.startswith("q" * 32768 + f"\n[... {1_000_001 - 65536} bytes cut: full output could not be saved ...]\n")
    assert text.endswith("\n[output cut: 934465 of 1000001 bytes not shown; the full output could not be saved]\n")
    assert len(text.encode()) == 65536 + len("\n[... 934465 bytes cut: full output could not be saved ...]\n") + len(
        "[output cut: 934465 of 1000001 bytes not shown; the full output could not be saved]\n")
    assert cell.announcements()[0]["path"] is None
    assert after.stream() == "still here\n"
    assert set(tmp_path.iterdir()) == {not_a_dir, stderr_path}
    assert not_a_dir.read_text() == ""
    log = stderr_path.read_text()
    assert "KERNEL_GATEWAY_OUTPUT_LIMIT='lots' is not an integer >= 2; using 65536" in log
    assert "creating the stdout spill file failed" in log

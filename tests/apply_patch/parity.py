"""Differential harness: the same patch on the same starting tree, once through
the reference Codex binary and once through ``apply_patch()``.

A tree is a dict ``{relative path: content}`` where content is ``str``/``bytes``
for a file, ``None`` for a directory, or ``Symlink(target)``.  Outputs are
compared after replacing each run's temp directory with ``<CWD>``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kernel_gateway.tools.apply_patch import apply_patch

REPO = Path(__file__).resolve().parents[2]
INSTALL_HINT = "run `bash tests/apply_patch/get_reference.sh`"


@dataclass(frozen=True)
class Symlink:
    target: str


def reference_path() -> Path:
    return Path(os.environ.get("APPLY_PATCH_REFERENCE", REPO / ".reference" / "bin" / "apply_patch"))


def build_tree(root: str, tree: dict) -> None:
    for rel, content in sorted(tree.items()):
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if content is None:
            os.makedirs(path, exist_ok=True)
        elif isinstance(content, Symlink):
            os.symlink(content.target, path)
        else:
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)


def snapshot(root: str) -> dict:
    """Every entry under root: file bytes, None for a directory, Symlink for a link."""
    tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                tree[rel] = Symlink(os.readlink(path))
            elif os.path.isdir(path):
                tree[rel] = None
            else:
                with open(path, "rb") as f:
                    tree[rel] = f.read()
    return tree


@dataclass
class Outcome:
    ok: bool
    output: str
    tree: dict


def run_reference(binary: Path, cwd: str, patch: str) -> Outcome:
    proc = subprocess.run([str(binary), patch], cwd=cwd, capture_output=True, timeout=30)
    # The reference prints to one stream per run; keep both in print order anyway.
    output = (proc.stdout + proc.stderr).decode("utf-8", "replace").replace(cwd, "<CWD>")
    return Outcome(proc.returncode == 0, output, snapshot(cwd))


def run_ours(cwd: str, patch: str) -> Outcome:
    result = apply_patch(patch, cwd)
    return Outcome(result.ok, result.output.replace(cwd, "<CWD>"), snapshot(cwd))


def compare(binary: Path, tree: dict, patch: str) -> tuple[Outcome, Outcome]:
    """Run both on fresh copies of `tree`; returns (reference, ours)."""
    ref_dir = os.path.realpath(tempfile.mkdtemp(prefix="ap-ref-"))
    our_dir = os.path.realpath(tempfile.mkdtemp(prefix="ap-our-"))
    try:
        build_tree(ref_dir, tree)
        build_tree(our_dir, tree)
        return run_reference(binary, ref_dir, patch), run_ours(our_dir, patch)
    finally:
        shutil.rmtree(ref_dir)
        shutil.rmtree(our_dir)


def mismatch(ref: Outcome, ours: Outcome) -> str | None:
    """A readable description of how the two runs differ, or None."""
    problems = []
    if ref.ok != ours.ok:
        problems.append(f"ok: reference={ref.ok} ours={ours.ok}")
    if ref.output != ours.output:
        problems.append(f"output:\n  reference={ref.output!r}\n  ours     ={ours.output!r}")
    if ref.tree != ours.tree:
        keys = sorted(set(ref.tree) | set(ours.tree))
        diff = [f"  {k}: reference={ref.tree.get(k, '<absent>')!r} ours={ours.tree.get(k, '<absent>')!r}"
                for k in keys if ref.tree.get(k, "<absent>") != ours.tree.get(k, "<absent>")]
        problems.append("tree:\n" + "\n".join(diff))
    return "\n".join(problems) or None

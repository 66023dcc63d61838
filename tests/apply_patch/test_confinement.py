"""apply_patch(..., root=...) refuses every way out of the root, before
changing anything, inside or outside the root."""

import os

import pytest

from kernel_gateway.tools.apply_patch import apply_patch

from .parity import build_tree, snapshot


def P(body: str) -> str:
    return f"*** Begin Patch\n{body}\n*** End Patch"


@pytest.fixture
def world(tmp_path):
    """<tmp>/agent is the root (with agent/work as cwd), <tmp>/outside and
    <tmp>/agent2 are neighbours that must never change."""
    root, outside, sibling = tmp_path / "agent", tmp_path / "outside", tmp_path / "agent2"
    build_tree(str(outside), {"secret.txt": "secret\n", "deep/x/y/secret.txt": "deep\n"})
    build_tree(str(sibling), {"secret.txt": "sibling\n"})
    build_tree(str(root), {"work/a.txt": "a\n", "work/sub/b.txt": "b\n"})
    os.symlink(str(outside), root / "work" / "out")                       # depth 1, absolute
    os.symlink("../../../outside/deep", root / "work" / "sub" / "rel_out")  # relative, escapes
    os.makedirs(root / "work" / "d1" / "d2")
    os.symlink("../../../../outside/deep/x", root / "work" / "d1" / "d2" / "d3")  # depth 3
    os.symlink("../../agent2", root / "work" / "sib")                     # prefix-sharing sibling
    os.symlink("sub", root / "work" / "inside")                           # stays inside: allowed
    return tmp_path, root


ESCAPES = {
    "dotdot_add": P("*** Add File: ../../outside/new.txt\n+x"),
    "dotdot_update": P("*** Update File: ../../outside/secret.txt\n@@\n-secret\n+pwned"),
    "dotdot_delete": P("*** Delete File: ../../outside/secret.txt"),
    "absolute_elsewhere": P("*** Delete File: {tmp}/outside/secret.txt"),
    "absolute_sibling_prefix": P("*** Update File: {tmp}/agent2/secret.txt\n@@\n-sibling\n+pwned"),
    "symlink_depth_1": P("*** Update File: out/secret.txt\n@@\n-secret\n+pwned"),
    "symlink_depth_1_add": P("*** Add File: out/new.txt\n+x"),
    "relative_symlink_out": P("*** Add File: sub/rel_out/new.txt\n+x"),
    "symlink_depth_3": P("*** Update File: d1/d2/d3/y/secret.txt\n@@\n-deep\n+pwned"),
    "symlink_to_prefix_sibling": P("*** Delete File: sib/secret.txt"),
    "symlink_itself_deleted": P("*** Delete File: out"),
    "move_out_of_tree": P("*** Update File: a.txt\n*** Move to: ../../outside/moved.txt\n@@\n-a\n+A"),
    "move_through_symlink": P("*** Update File: a.txt\n*** Move to: out/moved.txt\n@@\n-a\n+A"),
    "first_hunk_fine_second_escapes": P("*** Add File: fine.txt\n+ok\n*** Update File: a.txt\n@@\n-a\n+A\n*** Add File: out/new.txt\n+x"),
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escape_is_refused_and_nothing_changes(world, name):
    tmp, root = world
    before = snapshot(str(tmp))
    result = apply_patch(ESCAPES[name].format(tmp=tmp), root / "work", root=root)
    assert not result.ok
    assert result.output.startswith("Refused: path '") and "outside the workspace root" in result.output
    assert snapshot(str(tmp)) == before


def test_inside_symlink_and_plain_paths_are_allowed(world):
    tmp, root = world
    patch = P("*** Update File: inside/b.txt\n@@\n-b\n+B\n*** Add File: new/dir/c.txt\n+c\n"
              "*** Update File: a.txt\n*** Move to: sub/moved.txt\n@@\n-a\n+A\n*** Delete File: sub/../sub/b.txt\n"
              "*** Add File: sub/b.txt\n+again")
    result = apply_patch(patch, root / "work", root=root)
    assert result.ok, result.output
    assert (root / "work" / "sub" / "moved.txt").read_text() == "A\n"
    assert (root / "work" / "new" / "dir" / "c.txt").read_text() == "c\n"
    assert (root / "work" / "sub" / "b.txt").read_text() == "again\n"
    assert not (root / "work" / "a.txt").exists()


def test_confined_output_matches_unconfined(world, tmp_path_factory):
    """Confinement adds a check, not a different behaviour."""
    tmp, root = world
    patch = P("*** Update File: a.txt\n@@\n-zzz\n+A")
    confined = apply_patch(patch, root / "work", root=root)
    plain = apply_patch(patch, root / "work")
    assert confined == plain and not confined.ok

"""Named scenarios, each run through the reference binary and through
apply_patch() on identical trees: same files, same ok-ness, same output."""

import pytest

from .parity import Symlink, compare, mismatch


def P(body: str) -> str:
    return f"*** Begin Patch\n{body}\n*** End Patch"


CODE = "def f():\n    return 1\n\n\ndef g():\n    return 2\n\n\nclass C:\n    def f(self):\n        return 3\n"

SCENARIOS = {
    # --- the basic operations
    "add_file": ({}, P("*** Add File: new.txt\n+hello\n+world")),
    "add_empty_file": ({}, P("*** Add File: empty.txt")),
    "add_file_blank_line_content": ({}, P("*** Add File: b.txt\n+\n+x\n+")),
    "add_in_new_subdirectories": ({}, P("*** Add File: a/b/c/new.txt\n+deep")),
    "add_path_with_spaces": ({}, P("*** Add File: my dir/my file.txt\n+spaced")),
    "add_overwrites_existing": ({"dup.txt": "old\n"}, P("*** Add File: dup.txt\n+new")),
    "add_under_a_file_fails": ({"f": "x\n"}, P("*** Add File: f/g.txt\n+y")),
    "add_onto_directory_fails": ({"d/x": "1\n"}, P("*** Add File: d\n+y")),
    "delete_file": ({"gone.txt": "bye\n", "keep.txt": "k\n"}, P("*** Delete File: gone.txt")),
    "delete_missing_file": ({"keep.txt": "k\n"}, P("*** Delete File: nope.txt")),
    "delete_directory_fails": ({"d/x": "1\n"}, P("*** Delete File: d")),
    "delete_non_utf8_file": ({"bin": b"\xff\xfe\x00"}, P("*** Delete File: bin")),
    "update_simple": ({"a.txt": "one\ntwo\nthree\n"}, P("*** Update File: a.txt\n@@\n one\n-two\n+TWO\n three")),
    "update_missing_file": ({}, P("*** Update File: nope.txt\n@@\n-a\n+b")),
    "update_directory_fails": ({"d/x": "1\n"}, P("*** Update File: d\n@@\n-a\n+b")),
    "update_non_utf8_fails": ({"bin": b"ok\n\xc3\x28\n"}, P("*** Update File: bin\n@@\n-ok\n+OK")),
    "update_truncated_utf8_fails": ({"bin": b"ok\n\xe2\x82"}, P("*** Update File: bin\n@@\n-ok\n+OK")),
    "update_through_file_component": ({"f": "x\n"}, P("*** Update File: f/g\n@@\n-a\n+b")),
    "move_file": ({"old/name.txt": "a\nb\n"}, P("*** Update File: old/name.txt\n*** Move to: renamed/dir/name.txt\n@@\n-a\n+A")),
    "move_onto_existing_file": (
        {"src.txt": "s\n", "dst.txt": "d\n"},
        P("*** Update File: src.txt\n*** Move to: dst.txt\n@@\n-s\n+S"),
    ),
    "move_onto_itself_deletes": ({"f.txt": "a\n"}, P("*** Update File: f.txt\n*** Move to: f.txt\n@@\n-a\n+b")),
    "move_path_trailing_spaces": ({"f.txt": "a\n"}, P("*** Update File: f.txt\n*** Move to:  g.txt  \n@@\n-a\n+b")),
    # --- chunks and context
    "multiple_chunks": (
        {"m.txt": "1\n2\n3\n4\n5\n6\n"},
        P("*** Update File: m.txt\n@@\n-2\n+two\n@@\n 4\n-5\n+five"),
    ),
    "context_header": ({"c.py": CODE}, P("*** Update File: c.py\n@@ def g():\n-    return 2\n+    return 20")),
    "nested_context_headers": (
        {"c.py": CODE},
        P("*** Update File: c.py\n@@ class C:\n@@     def f(self):\n-        return 3\n+        return 30"),
    ),
    "context_header_not_found": ({"c.py": CODE}, P("*** Update File: c.py\n@@ def nope():\n-    return 2\n+    return 3")),
    "context_lines_not_found": ({"a.txt": "x\ny\n"}, P("*** Update File: a.txt\n@@\n-nothing\n+here")),
    "first_chunk_without_header": ({"a.txt": "x\ny\n"}, P("*** Update File: a.txt\n x\n-y\n+Y")),
    "pure_addition_appends": ({"a.txt": "x\ny\n"}, P("*** Update File: a.txt\n@@ x\n+added")),
    "deletion_only": ({"a.txt": "x\ny\nz\n"}, P("*** Update File: a.txt\n@@\n-y")),
    "delete_every_line": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x")),
    "end_of_file_marker": ({"t.txt": "a\nb\na\n"}, P("*** Update File: t.txt\n@@\n-a\n+END\n*** End of File")),
    "end_of_file_not_at_end": ({"t.txt": "a\nb\nc\n"}, P("*** Update File: t.txt\n@@\n-b\n+B\n*** End of File")),
    "chunks_out_of_order_fail": ({"m.txt": "1\n2\n3\n"}, P("*** Update File: m.txt\n@@\n-3\n+x\n@@\n-1\n+y")),
    "trailing_empty_context_line": ({"a.txt": "x\ny\n"}, P("*** Update File: a.txt\n@@\n-y\n+Y\n ")),
    # --- the four matching passes
    "match_exact": ({"a.txt": "  x  \nx\n"}, P("*** Update File: a.txt\n@@\n-x\n+X")),
    "match_ignoring_trailing_whitespace": ({"a.txt": "x   \t\ny\n"}, P("*** Update File: a.txt\n@@\n-x\n+X")),
    "match_ignoring_surrounding_whitespace": ({"a.txt": "    x\ny\n"}, P("*** Update File: a.txt\n@@\n-x\n+X")),
    "match_unicode_dashes": ({"a.txt": "a \u2013 b \u2014 c \u2212 d\n"}, P("*** Update File: a.txt\n@@\n-a - b - c - d\n+ascii")),
    "match_unicode_quotes": ({"a.txt": "\u201cq\u201d \u2018s\u2019\n"}, P("*** Update File: a.txt\n@@\n-\"q\" 's'\n+plain")),
    "match_unicode_spaces": ({"a.txt": "a\u00a0b\u2009c\u3000d\n"}, P("*** Update File: a.txt\n@@\n-a b c d\n+spaces")),
    "unicode_in_patch_not_file": ({"a.txt": "a - b\n"}, P("*** Update File: a.txt\n@@\n-a \u2014 b\n+dash")),
    "unicode_context_header": ({"a.txt": "sec \u2014 one\nv\n"}, P("*** Update File: a.txt\n@@ sec - one\n-v\n+V")),
    "unit_separator_is_not_whitespace": ({"a.txt": "x\x1f\ny\n"}, P("*** Update File: a.txt\n@@\n-x\n+X")),
    # --- line endings and final newlines
    "no_trailing_newline_gets_one": ({"n.txt": "a\nb"}, P("*** Update File: n.txt\n@@\n-a\n+A")),
    "crlf_file_keeps_crlf": ({"w.txt": "a\r\nb\r\nc\r\n"}, P("*** Update File: w.txt\n@@\n-b\n+B\n+B2")),
    "mixed_endings_first_wins": ({"w.txt": "a\nb\r\nc\r\n"}, P("*** Update File: w.txt\n@@\n-c\n+C")),
    "update_empty_file": ({"e.txt": ""}, P("*** Update File: e.txt\n@@\n+first")),
    "crlf_patch_text": ({"a.txt": "x\n"}, "*** Begin Patch\r\n*** Update File: a.txt\r\n@@\r\n-x\r\n+y\r\n*** End Patch\r\n"),
    # --- leniency of the envelope
    "whitespace_around_markers": ({"a.txt": "x\n"}, "  *** Begin Patch  \n  *** Update File: a.txt\n@@  \n-x\n+y\n *** End Patch \n\n"),
    "heredoc_quoted": ({}, "<<'EOF'\n*** Begin Patch\n*** Add File: h.txt\n+x\n*** End Patch\nEOF\n"),
    "heredoc_plain": ({}, "<<EOF\n*** Begin Patch\n*** Add File: h.txt\n+x\n*** End Patch\nEOF"),
    "heredoc_without_patch_inside": ({}, "<<EOF\n*** Begin Patch\njunk\nEOF"),
    "blank_lines_between_chunks_after_eof": (
        {"t.txt": "a\nb\nc\n"},
        P("*** Update File: t.txt\n@@\n-c\n+C\n*** End of File\n\n\n*** Add File: n.txt\n+n"),
    ),
    "stray_end_of_file_before_first_chunk": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n*** End of File\n-x\n+y")),
    # --- invalid patches
    "empty_patch": ({}, ""),
    "only_begin_and_end": ({"a.txt": "x\n"}, "*** Begin Patch\n*** End Patch"),
    "missing_begin": ({}, "*** Add File: a.txt\n+x\n*** End Patch"),
    "missing_end": ({}, "*** Begin Patch\n*** Add File: a.txt\n+x"),
    "invalid_hunk_header": ({}, P("*** Frobnicate File: a.txt")),
    "add_line_without_plus": ({}, P("*** Add File: a.txt\n+x\ny")),
    "update_without_chunks": ({"a.txt": "x\n"}, P("*** Update File: a.txt")),
    "bad_line_inside_chunk": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n?what")),
    "bad_first_line_of_chunk": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n?what")),
    "empty_chunk_header_only": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@")),
    "end_of_file_with_nothing_before": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n*** End of File")),
    "second_chunk_without_header": ({"a.txt": "x\ny\n"}, P("*** Update File: a.txt\n@@\n-x\n*** End of File\n-y")),
    # --- a doubled end marker (applied by the reference) and text after an inner one (refused)
    "double_end_after_update": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n*** End Patch")),
    "double_end_after_add": ({}, P("*** Add File: n.txt\n+n\n*** End Patch")),
    "double_end_after_delete": ({"d.txt": "d\n"}, P("*** Delete File: d.txt\n*** End Patch")),
    "double_end_after_end_of_file": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n*** End of File\n*** End Patch")),
    "double_end_with_blank_lines_between": ({}, P("*** Add File: n.txt\n+n\n*** End Patch\n\n  \t")),
    "double_end_inner_with_trailing_space": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n*** End Patch   ")),
    "double_end_inner_indented_after_add": ({}, P("*** Add File: n.txt\n+n\n\t*** End Patch ")),
    "double_end_inner_indented_in_update": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n\t*** End Patch")),
    "double_end_only": ({"a.txt": "x\n"}, P("*** End Patch")),
    "double_end_heredoc": ({}, "<<EOF\n*** Begin Patch\n*** Add File: h.txt\n+x\n*** End Patch\n*** End Patch\nEOF"),
    "double_end_crlf": ({}, "*** Begin Patch\r\n*** Add File: n.txt\r\n+n\r\n*** End Patch\r\n*** End Patch\r\n"),
    "whitespace_line_after_chunk_fails": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n\t")),
    "whitespace_line_after_end_of_file_chunk": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n*** End of File\n\t")),
    "whitespace_line_before_inner_end_fails": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n\t\n*** End Patch")),
    "empty_line_before_inner_end": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n\n*** End Patch")),
    "empty_chunk_before_inner_end": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n*** End Patch")),
    "triple_end": ({}, P("*** Add File: n.txt\n+n\n*** End Patch\n*** End Patch")),
    "text_after_inner_end": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n*** End Patch\ngarbage")),
    "context_after_inner_end": ({"a.txt": "x\n"}, P("*** Update File: a.txt\n@@\n-x\n+y\n*** End Patch\n x")),
    "hunk_after_inner_end": ({}, P("*** Add File: n.txt\n+n\n*** End Patch\n*** Add File: m.txt\n+m")),
    "add_line_after_inner_end": ({}, P("*** Add File: n.txt\n+n\n*** End Patch\n+more")),
    "inner_end_with_text_on_its_line": ({}, P("*** Add File: n.txt\n+n\n*** End Patch extra")),
    "end_marker_as_context_line": (
        {"c.txt": "a\n*** End Patch\nb\n"},
        P("*** Update File: c.txt\n@@\n a\n *** End Patch\n-b\n+B"),
    ),
    # --- order and partial failure
    "multiple_files": (
        {"m.txt": "m\n", "d.txt": "d\n"},
        P("*** Delete File: d.txt\n*** Update File: m.txt\n@@\n-m\n+M\n*** Add File: n.txt\n+n"),
    ),
    "partial_failure_keeps_earlier_changes": (
        {"a.txt": "a\n", "b.txt": "b\n"},
        P("*** Add File: created.txt\n+c\n*** Update File: a.txt\n@@\n-a\n+A\n*** Update File: b.txt\n@@\n-zzz\n+Z"),
    ),
    "partial_failure_on_second_chunk_of_file": (
        {"a.txt": "1\n2\n3\n"},
        P("*** Update File: a.txt\n@@\n-1\n+one\n@@\n-9\n+nine"),
    ),
    "same_file_updated_twice": ({"a.txt": "1\n2\n"}, P("*** Update File: a.txt\n@@\n-1\n+one\n*** Update File: a.txt\n@@\n-2\n+two")),
    "paths_with_dot_segments": ({"a.txt": "x\n"}, P("*** Update File: ./sub/../a.txt\n@@\n-x\n+y")),
    "update_through_symlink": ({"real.txt": "x\n", "link.txt": Symlink("real.txt")}, P("*** Update File: link.txt\n@@\n-x\n+y")),
    "delete_symlink_keeps_target": ({"real.txt": "x\n", "link.txt": Symlink("real.txt")}, P("*** Delete File: link.txt")),
    "update_symlink_loop": ({"loop": Symlink("loop")}, P("*** Update File: loop\n@@\n-x\n+y")),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario(reference, name):
    tree, patch = SCENARIOS[name]
    ref, ours = compare(reference, tree, patch)
    problem = mismatch(ref, ours)
    assert problem is None, f"scenario {name!r}\npatch={patch!r}\n{problem}"


def test_enough_scenarios():
    assert len(SCENARIOS) >= 45

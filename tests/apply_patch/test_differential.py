"""Randomised differential test: seeded random trees and patches (valid ones
derived from the files' real lines with whitespace and Unicode perturbations,
and broken ones), each run through the reference binary and apply_patch().

APPLY_PATCH_FUZZ_CASES raises the number of cases, APPLY_PATCH_FUZZ_SEED
changes the seed; a failure names the case so it can be replayed with
``generate_case(seed, case)``.
"""

import os
import random
from concurrent.futures import ThreadPoolExecutor

from .parity import compare, mismatch

SEED = int(os.environ.get("APPLY_PATCH_FUZZ_SEED", "20240611"))
CASES = max(2000, int(os.environ.get("APPLY_PATCH_FUZZ_CASES", "2000")))

WORDS = [
    "def f():", "    return 1", "", "x = 1", "a - b", "a \u2013 b", "a \u2014 b", "\u201cquoted\u201d",
    '"quoted"', "it\u2019s", "it's", "tab\there", "  indented", "trailing  ", "nbsp\u00a0here",
    "nbsp here", "*** not a marker", "@@ not a header", "+plus", "-minus", " space", "end",
    "class C:", "    pass", "x\x1f", "\u3000wide",
]
NAMES = ["a.txt", "b.py", "dir/c.txt", "dir/sub/d.md", "e f.txt", "g"]
# Perturbations an author's copy of a line may carry.
PERTURB = [
    lambda s: s + " ", lambda s: s + "\t", lambda s: "  " + s, lambda s: s.strip(),
    lambda s: s.replace("-", "\u2013"), lambda s: s.replace("\u2013", "-").replace("\u2014", "-"),
    lambda s: s.replace('"', "\u201d"), lambda s: s.replace("\u2019", "'"),
    lambda s: s.replace(" ", "\u00a0"), lambda s: s.replace("\u00a0", " "),
    lambda s: s + "x",
]


def _content(rng):
    lines = [rng.choice(WORDS) for _ in range(rng.randint(0, 8))]
    newline = "\r\n" if rng.random() < 0.15 else "\n"
    text = newline.join(lines)
    if lines and rng.random() < 0.8:
        text += newline
    return text


def _line(rng, text):
    return rng.choice(PERTURB)(text) if rng.random() < 0.2 else text


def _update_body(rng, lines):
    """Chunks derived from the file's lines, in file order."""
    body, pos = [], 0
    for index in range(rng.randint(1, 3)):
        if pos > len(lines):
            break
        start = rng.randint(pos, len(lines))
        before = rng.randint(0, min(2, len(lines) - start))
        removed = rng.randint(0, min(2, len(lines) - start - before))
        after = rng.randint(0, min(2, len(lines) - start - before - removed))
        header = rng.random()
        if header < 0.5 or index > 0:
            if header < 0.25 and start > 0:
                body.append("@@ " + _line(rng, lines[rng.randint(0, start - 1)]))
            else:
                body.append("@@")
        seg = lines[start:start + before + removed + after]
        for i, text in enumerate(seg):
            mark = "-" if before <= i < before + removed else " "
            body.append(mark + _line(rng, text))
            if i == before + removed - 1 or (removed == 0 and i == before - 1):
                body += ["+" + rng.choice(WORDS) for _ in range(rng.randint(0, 2))]
        if not seg:
            body += ["+" + rng.choice(WORDS) for _ in range(rng.randint(1, 2))]
        if start + len(seg) == len(lines) and rng.random() < 0.3:
            body.append("*** End of File")
        pos = start + len(seg)
    return body


def _hunk(rng, tree):
    existing = [n for n, c in tree.items() if isinstance(c, str)]
    kind = rng.random()
    path = rng.choice(existing) if existing and rng.random() < 0.85 else rng.choice(NAMES)
    if kind < 0.2:
        return [f"*** Add File: {rng.choice(NAMES)}"] + ["+" + rng.choice(WORDS) for _ in range(rng.randint(0, 3))]
    if kind < 0.3:
        return [f"*** Delete File: {path}"]
    shown = rng.choice([path] * 8 + ["./" + path, "dir/../" + path])
    head = [f"*** Update File: {shown}"]
    if rng.random() < 0.15:
        head.append(f"*** Move to: {rng.choice(NAMES)}" + rng.choice(["", " ", "\t"]))
    lines = _content_lines(tree.get(path))
    return head + _update_body(rng, lines)


def _content_lines(content):
    if not isinstance(content, str):
        return ["x"]
    parts = content.split("\n")
    if parts[-1] == "":
        parts.pop()
    return [p[:-1] if p.endswith("\r") else p for p in parts]


MUTATIONS = [
    lambda rng, ls: ls.insert(rng.randint(1, len(ls) - 1), rng.choice(["", "   ", "garbage", "@@", "*** End of File", "?x"])),
    lambda rng, ls: ls.pop(rng.randint(0, len(ls) - 1)),
    lambda rng, ls: ls.__setitem__(0, "*** Begin  Patch"),
    lambda rng, ls: ls.__setitem__(len(ls) - 1, "*** End Patch junk"),
    lambda rng, ls: _mutate_line(rng, ls, lambda s: s.replace("***", "**")),
    lambda rng, ls: _mutate_line(rng, ls, lambda s: s[1:]),
    lambda rng, ls: _mutate_line(rng, ls, lambda s: "  " + s + "  "),
    lambda rng, ls: _mutate_line(rng, ls, lambda s: s + "zz"),
    lambda rng, ls: _mutate_line(rng, ls, lambda s: s.replace("@@", "@@ ")),
    lambda rng, ls: ls.insert(len(ls) - 1, "*** Delete File: nope.txt"),
    lambda rng, ls: ls.insert(rng.randint(1, len(ls) - 1), rng.choice(["*** Move to: g", "*** End of File  ", "@@ \t"])),
    lambda rng, ls: _mutate_line(rng, ls, lambda s: s + "\r"),
]


# Endings after the patch's own `*** End Patch`: a doubled marker (with blank
# lines, whitespace or an indent around it), a third one, or text, a hunk or
# an add line between the inner marker and a final one.
ENDINGS = [
    lambda rng: ["*** End Patch"],
    lambda rng: ["*** End Patch" + rng.choice(["", " ", "\t", "  "])],
    lambda rng: [rng.choice(["", "   ", "\t"])] * rng.randint(1, 2) + ["*** End Patch"],
    lambda rng: [rng.choice([" ", "\t", "  "]) + "*** End Patch"],
    lambda rng: ["*** End Patch", "*** End Patch"],
    lambda rng: [rng.choice(["garbage", " x", "+more", "@@", "*** End of File", "*** Add File: z.txt"]), "*** End Patch"],
    lambda rng: ["*** End Patch junk", "*** End Patch"],
]


def _mutate_line(rng, lines, change):
    i = rng.randint(0, len(lines) - 1)
    lines[i] = change(lines[i])


def generate_case(seed: int, case: int):
    rng = random.Random(f"{seed}:{case}")
    tree = {}
    for _ in range(rng.randint(1, 4)):
        tree[rng.choice(NAMES)] = _content(rng)
    if rng.random() < 0.05:
        tree["dir/emptydir"] = None
    lines = ["*** Begin Patch"]
    for _ in range(rng.randint(1, 3)):
        lines += _hunk(rng, tree)
    lines.append("*** End Patch")
    if rng.random() < 0.2:
        if rng.random() < 0.3:
            lines[-1] = rng.choice([" ", "\t", ""]) + "*** End Patch" + rng.choice(["", " ", "\t"])
        lines += rng.choice(ENDINGS)(rng)
    if rng.random() < 0.3:
        for _ in range(rng.randint(1, 2)):
            rng.choice(MUTATIONS)(rng, lines)
    patch = "\n".join(lines) + ("\n" if rng.random() < 0.5 else "")
    if rng.random() < 0.03:
        patch = "<<'EOF'\n" + patch + "\nEOF\n"
    return tree, patch


def _run(reference, case):
    tree, patch = generate_case(SEED, case)
    ref, ours = compare(reference, tree, patch)
    problem = mismatch(ref, ours)
    if problem:
        return (f"case {case} (seed {SEED}; replay with generate_case({SEED}, {case}))\n"
                f"tree={tree!r}\npatch={patch!r}\n{problem}")
    return None


def test_differential(reference):
    with ThreadPoolExecutor(max_workers=4) as pool:
        failures = [f for f in pool.map(lambda c: _run(reference, c), range(CASES)) if f]
    assert not failures, f"{len(failures)} of {CASES} cases differ; first ones:\n\n" + "\n\n".join(failures[:3])

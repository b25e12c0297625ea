"""The built-in tools' working directory: every way out of it is refused, .gitignore is respected,
reads and searches are bounded, edits apply exactly and say what they changed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from app.tools.errors import ToolInputError
from app.tools.workdir import MAX_LIST, Workdir


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Workdir, Path]:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / "pkg").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text("secret\n")
    (root / "pkg" / "mod.py").write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n")
    (root / "README.md").write_text("hello\n")
    (root / "to_outside.txt").symlink_to(outside / "secret.txt")
    (root / "outdir").symlink_to(outside, target_is_directory=True)
    (root / "inner_link.py").symlink_to(root / "pkg" / "mod.py")
    return Workdir.open(root), outside


ESCAPES = ["../outside/secret.txt", "pkg/../../outside/secret.txt", "/etc/passwd", "to_outside.txt",
           "outdir/secret.txt", "outdir", "pkg/mod.py\x00.txt", "~/secret.txt", "", "  ", "..", "C:\\x"]


@pytest.mark.parametrize("path", ESCAPES)
def test_every_way_out_is_refused(tree, path: str) -> None:
    work, outside = tree
    for call in (lambda: work.read_file(path), lambda: work.list_files(path),
                 lambda: work.search("secret", path),
                 lambda: work.apply_edit(path, search="secret", replace="stolen")):
        with pytest.raises(ToolInputError) as e:
            call()
        assert "\n" not in str(e.value)
    assert (outside / "secret.txt").read_text() == "secret\n"


def test_no_write_through_a_symlinked_parent_even_to_create(tree) -> None:
    work, outside = tree
    with pytest.raises(ToolInputError, match="outside"):
        work.apply_edit("outdir/new.txt", search="", replace="x")
    assert not (outside / "new.txt").exists()


def test_links_out_are_not_listed_nor_searched(tree) -> None:
    work, _ = tree
    listed = work.list_files().splitlines()
    assert "to_outside.txt" not in listed and not any(p.startswith("outdir") for p in listed)
    assert "inner_link.py" in listed  # a link that stays inside is a file like any other
    assert "no matches" in work.search("secret")


def test_git_dir_is_not_editable(tree) -> None:
    work, _ = tree
    (work.root / ".git").mkdir()
    (work.root / ".git" / "config").write_text("[core]\n")
    with pytest.raises(ToolInputError, match=".git"):
        work.apply_edit(".git/config", search="[core]", replace="[x]")


def test_gitignore_in_a_repository(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("build/\n*.log\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "out.c").write_text("x")
    (tmp_path / "run.log").write_text("x")
    (tmp_path / "main.c").write_text("int main;\n")
    assert Workdir.open(tmp_path).list_files().splitlines() == [".gitignore", "main.c", "(2 files)"]


def test_gitignore_without_git(tmp_path: Path) -> None:
    (tmp_path / ".gitignore").write_text("build/\n*.log\n# comment\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "out.c").write_text("x")
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "x.js").write_text("x")
    (tmp_path / "run.log").write_text("x")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.c").write_text("int main;\n")
    work = Workdir.open(tmp_path)
    assert work.list_files().splitlines() == [".gitignore", "src/main.c", "(2 files)"]
    assert work.list_files("src").splitlines() == ["src/main.c", "(1 file)"]
    assert work.list_files(pattern="*.c").splitlines() == ["src/main.c", "(1 file)"]


def test_listing_is_bounded(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"f{i:02}.txt").write_text("x")
    lines = Workdir.open(tmp_path).list_files(limit=10).splitlines()
    assert lines[:10] == [f"f{i:02}.txt" for i in range(10)]
    assert lines[10:] == ["... 20 more: 30 files in all (narrow with path or pattern)"]
    assert len(Workdir.open(tmp_path).list_files(limit=10**9).splitlines()) == 31 <= MAX_LIST


def test_a_missing_path_names_the_files_it_may_mean(tree) -> None:
    work, _ = tree
    for call in (lambda p: work.read_file(p), lambda p: work.search("x", p), lambda p: work.list_files(p)):
        with pytest.raises(ToolInputError, match=r"^'mod\.py' does not exist; did you mean 'pkg/mod\.py'\?$"):
            call("mod.py")
        with pytest.raises(ToolInputError, match=r"'pkg/modd\.py' does not exist; did you mean 'pkg/mod\.py'"):
            call("pkg/modd.py")
        with pytest.raises(ToolInputError, match="'config.py' does not exist; search finds the file that holds a name"):
            call("config.py")


def test_read_ranges_and_limits(tree) -> None:
    work, _ = tree
    assert work.read_file("pkg/mod.py", 2, 2) == "pkg/mod.py: lines 2-2 of 6 (more: read_file with start_line=3)\n    return a + b\n"
    assert work.read_file("pkg/mod.py").startswith("pkg/mod.py: lines 1-6 of 6\ndef add")
    with pytest.raises(ToolInputError, match="past the end"):
        work.read_file("pkg/mod.py", 50)
    with pytest.raises(ToolInputError, match="does not exist"):
        work.read_file("nope.py")
    with pytest.raises(ToolInputError, match="not a file"):
        work.read_file("pkg")
    (work.root / "big.txt").write_text("".join(f"{i}\n" for i in range(5000)))
    header = work.read_file("big.txt").splitlines()[0]
    assert header == "big.txt: lines 1-2000 of 5000 (more: read_file with start_line=2001)"


def test_binary_files_are_refused(tree) -> None:
    work, _ = tree
    (work.root / "blob.bin").write_bytes(b"\x7fELF\x00\x01\x02")
    (work.root / "latin1.txt").write_bytes(b"caf\xe9\n")
    for path, reason in (("blob.bin", "binary"), ("latin1.txt", "UTF-8")):
        with pytest.raises(ToolInputError, match=reason):
            work.read_file(path)
        with pytest.raises(ToolInputError, match=reason):
            work.apply_edit(path, search="caf", replace="x")
    assert (work.root / "blob.bin").read_bytes() == b"\x7fELF\x00\x01\x02"


def test_search_with_context_and_bounds(tree) -> None:
    work, _ = tree
    out = work.search(r"def \w+", path="pkg", context=1)
    assert out.splitlines() == ["pkg/mod.py:1: def add(a, b):", "pkg/mod.py-2-     return a + b",
                                "--", "pkg/mod.py-4- ", "pkg/mod.py:5: def sub(a, b):", "pkg/mod.py-6-     return a - b",
                                "(2 matches in 1 file)"]
    assert work.search("return", max_matches=1, context=0).splitlines()[-1].startswith("... stopped at 1 matches")
    assert "README.md:1: hello" in work.search("HELLO", ignore_case=True)
    assert work.search("hello", glob="*.py") == "no matches for 'hello'"
    with pytest.raises(ToolInputError, match="not a valid regular expression"):
        work.search("(unclosed")


def test_search_names_the_definition_that_holds_a_match(tree) -> None:
    work, _ = tree
    (work.root / "pkg" / "shop.py").write_text(
        "RATE = 2\n\n\nclass Cart:\n    def total(self, items):\n        n = 0\n        for x in items:\n"
        "            n += x * RATE\n        return n\n")
    # As `git grep -p`: the holder once, above the first match it holds; none at the top level.
    assert work.search("RATE", path="pkg/shop.py", context=0).splitlines() == [
        "pkg/shop.py:1: RATE = 2", "--", "pkg/shop.py=5=     def total(self, items):",
        "pkg/shop.py:8:             n += x * RATE", "(2 matches in 1 file)"]
    assert work.search(r"n \+=|return n", path="pkg/shop.py", context=0).splitlines()[:3] == [
        "pkg/shop.py=5=     def total(self, items):", "pkg/shop.py:8:             n += x * RATE",
        "pkg/shop.py:9:         return n"]
    # In view already (context): not repeated.
    assert not any(line.startswith("pkg/mod.py=") for line in work.search("return a", path="pkg/mod.py", context=1).splitlines())


def test_a_search_that_finds_nothing_names_where_its_names_are_defined(tree) -> None:
    work, _ = tree
    missed = work.search("sub(2, 1)")  # inner_link.py, a link to pkg/mod.py, is named too
    assert missed.startswith("no matches for 'sub(2, 1)' (as a regular expression); sub is defined at ")
    assert "; sub is defined at pkg/mod.py:5: def sub(a, b):" in missed
    assert work.search("mul(2, 1)") == "no matches for 'mul(2, 1)'"
    assert work.search("sub(2, 1)", glob="*.md") == "no matches for 'sub(2, 1)'"


def test_listing_a_file_gives_its_outline(tree) -> None:
    work, _ = tree
    assert work.list_files("pkg/mod.py").splitlines() == [
        "pkg/mod.py is a file of 6 lines; its 2 definitions:", "1: def add(a, b):", "5: def sub(a, b):"]
    assert work.list_files("README.md") == "README.md is a file of 1 line, with no definitions; read_file reads it"


def test_search_replace_edit(tree) -> None:
    work, _ = tree
    diff = work.apply_edit("pkg/mod.py", search="return a + b", replace="return b + a")
    assert diff.splitlines()[:3] == ["--- a/pkg/mod.py", "+++ b/pkg/mod.py", "@@ -1,5 +1,5 @@"]
    assert "-    return a + b" in diff and "+    return b + a" in diff
    assert "return b + a" in (work.root / "pkg/mod.py").read_text()
    with pytest.raises(ToolInputError, match="2 times"):
        work.apply_edit("pkg/mod.py", search="(a, b)", replace="(x, y)")
    with pytest.raises(ToolInputError, match="not found"):
        work.apply_edit("pkg/mod.py", search="nothing like it", replace="x")
    with pytest.raises(ToolInputError, match="either"):
        work.apply_edit("pkg/mod.py")


def test_diff_edit_tolerates_wrong_line_numbers(tree) -> None:
    work, _ = tree
    diff = "--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -40,2 +40,2 @@\n def sub(a, b):\n-    return a - b\n+    return a - b - 0\n"
    applied = work.apply_edit("pkg/mod.py", diff=diff)
    assert "+    return a - b - 0" in applied
    assert (work.root / "pkg/mod.py").read_text().endswith("    return a - b - 0\n")
    with pytest.raises(ToolInputError, match="does not match"):
        work.apply_edit("pkg/mod.py", diff="@@ -1 +1 @@\n-nothing\n+x\n")


def test_create_file_and_keep_mode(tree) -> None:
    work, _ = tree
    diff = work.apply_edit("pkg/new.py", search="", replace="x = 1\n")
    assert diff.startswith("--- /dev/null\n+++ b/pkg/new.py")
    assert (work.root / "pkg/new.py").read_text() == "x = 1\n"
    script = work.root / "run.sh"
    script.write_text("echo a\n")
    script.chmod(0o755)
    work.apply_edit("run.sh", search="echo a", replace="echo b")
    assert os.stat(script).st_mode & 0o777 == 0o755
    assert not [p for p in os.listdir(work.root) if p.endswith(".tmp")]

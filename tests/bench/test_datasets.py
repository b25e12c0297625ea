"""The workloads: seeded synthetic requests, and code-completion requests cut from sources."""

from __future__ import annotations

import random

from app.bench.datasets import FollowUps, Shape, fim_cut_points, make_requests, random_prompt


def test_requests_are_the_same_for_the_same_seed():
    shape = Shape(input_len=20, output_len=8, range_ratio=0.5)
    a, b = make_requests(shape, 5, 100, seed=3), make_requests(shape, 5, 100, seed=3)
    assert a == b and a != make_requests(shape, 5, 100, seed=4)
    assert all(10 <= len(ids) <= 30 and 4 <= n <= 12 and max(ids) < 100 for ids, n in a)
    fixed = make_requests(Shape(input_range="3,3", output_range="2,2"), 4, 50, seed=0)
    assert {(len(ids), n) for ids, n in fixed} == {(3, 2)}


def test_http_prompts_avoid_the_low_ids():
    ids = random_prompt(random.Random(0), 200, 1000)
    assert len(ids) == 200 and min(ids) >= 500 and max(ids) < 1000


def test_cut_points_end_the_prefix_at_the_cursor_lines_indent():
    cuts = fim_cut_points(4, seed=1)
    assert len(cuts) == 4
    for prefix, suffix in cuts:
        assert prefix.count("\n") == 30 and suffix.count("\n") <= 10
        assert not prefix.rsplit("\n", 1)[1].strip()  # the cursor line's indent, nothing typed yet


def test_follow_ups_type_one_line_above_the_cursor_each_time(tmp_path):
    source = tmp_path / "edited.py"
    source.write_text("".join(f"    line_{i} = {i}\n" for i in range(300)))
    extra = tmp_path / "extra.py"
    extra.write_text("".join(f"x{i} = {i}\n" for i in range(100)))
    bodies = FollowUps(file=source, cursor_line=170, prefix_lines=120, suffix_lines=40, extra_file=extra,
                       extra_lines=60).requests(3)
    assert [b["input_suffix"] for b in bodies] == [bodies[0]["input_suffix"]] * 3  # the suffix does not change
    assert bodies[0]["input_suffix"].startswith("    line_170 = 170\n") and bodies[0]["input_suffix"].count("\n") == 40
    assert bodies[0]["input_prefix"].startswith("    line_50 = 50\n") and bodies[0]["input_prefix"].endswith("line_169 = 169\n    ")
    assert bodies[2]["input_prefix"].endswith("line_169 = 169\n    # step 0\n    # step 1\n    ")
    assert bodies[0]["input_extra"] == [{"filename": "extra.py", "text": "".join(f"x{i} = {i}\n" for i in range(60))}]
    assert FollowUps(file=source, extra_file=None).requests(1)[0]["input_extra"] == []


def test_default_follow_ups_read_files_every_install_has():
    (body,) = FollowUps().requests(1)
    assert body["input_prefix"] and body["input_suffix"] and body["input_extra"][0]["text"]

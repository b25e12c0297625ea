"""The reply footer's prefix-cache figure says how much of the cached prompt came from disk."""

from app.ui.chat import cache_hit_text


def test_the_footer_names_the_disk_tier_only_when_it_served_tokens():
    assert cache_hit_text(None) == ""
    assert cache_hit_text((720, 777, 0)) == " · prefix cache 720 / 777 prompt tok"
    assert cache_hit_text((3536, 3562, 3520)) == " · prefix cache 3,536 / 3,562 prompt tok (3,520 from disk)"

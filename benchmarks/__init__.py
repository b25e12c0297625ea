"""Research benchmarks beyond `localbatch bench`, grouped by what they measure (see README.md).
Each runs from a checkout as `localbatch bench research NAME` (registered in app/bench/research.py)."""

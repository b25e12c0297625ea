"""Research benchmarks beyond `localbatch bench`, grouped by what they measure (see README.md).
Run each from the repository root as a module: `python -m benchmarks.<group>.<script> --help`."""

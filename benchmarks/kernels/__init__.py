"""Kernels and the decode step: attention against SDPA, step time against the memory roofline, a profile of a step."""

"""Numbers with one home that several layers use (a leaf module: it imports nothing of the package)."""

LOG2E = 1.4426950408889634
"""``1 / ln 2``: the fused kernels (Triton's and the CPU's) use ``exp2``, so their scores are in base-2 units."""

__all__ = ["LOG2E"]

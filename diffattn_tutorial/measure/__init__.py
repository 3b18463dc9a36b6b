"""Measuring: FLOP and byte models, timing and peak memory, CPU threads, GPU benchmark helpers, attention statistics of trained models."""

"""Benchmarks behind `exl2-backend bench`: measured bandwidth, decode/prefill speed, roofline ratios."""

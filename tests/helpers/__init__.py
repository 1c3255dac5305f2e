"""Test helpers shared across the suite (synthetic tensors, configs and model directories)."""

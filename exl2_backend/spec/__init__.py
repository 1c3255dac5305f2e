"""Speculative decoding: drafts proposed cheaply, verified by the target in one forward, output unchanged.

- `config.py`: `NgramConfig` and the `LoadSettings` defaults (`num_speculative_tokens`, k <= 15).
- `ngram.py`: prompt-lookup drafting (`NgramIndex`), no draft model.
- `draft_model.py`: a second EXL2 model with its own paged cache and decode graphs (`DraftModel`).
- `loader.py`, `vocab.py`, `memory.py`: loading a draft with vocabulary, context and memory checks.
- `rejection.py`: rejection sampling that keeps the target's distribution for sampled drafts.
- `adaptive.py`: the k controller (fixed, or from the running acceptance rate and step costs).
- `verify_graphs.py`: (k+1)-token verify steps replayed from CUDA graphs.
- `decoder.py`: `SpecDecoder`, the decode step the engine runs when speculation is configured.

Submodules are imported where used (runtime.settings imports `config` only), keeping this package light.
"""

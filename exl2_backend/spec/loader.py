"""Loading a draft model for an engine: vocabulary and context checks, memory planning, then the weights."""

from __future__ import annotations

from pathlib import Path

import torch

from exl2_backend.errors import ConfigError
from exl2_backend.runtime.settings import DEFAULT_MAX_SEQ_LEN
from exl2_backend.spec.draft_model import DraftModel
from exl2_backend.spec.memory import plan_draft
from exl2_backend.spec.vocab import check_vocab_compatible


def _tokenizer_or_none(tokenizer):
    return tokenizer if getattr(tokenizer, "backend", None) is not None else None


def load_draft(model, tokenizer, settings) -> DraftModel | None:
    """The draft model of `settings.draft_model` on the target's device, or None when none is configured.
    Raises VocabMismatchError, InsufficientMemoryError (before allocating), ConfigError, ModelFormatError."""
    if settings.draft_model is None:
        return None
    from exl2_backend.format.config import ModelConfig
    from exl2_backend.format.reader import load_weights
    from exl2_backend.model import LlamaModel
    from exl2_backend.tokenizer import Tokenizer

    draft_dir = Path(settings.draft_model)
    config = ModelConfig.from_dir(draft_dir)
    draft_tok = Tokenizer.from_dir(draft_dir) if (draft_dir / "tokenizer.json").is_file() else None
    check_vocab_compatible(model.config, _tokenizer_or_none(tokenizer), config, draft_tok, draft_dir)
    context = settings.max_seq_len or min(int(model.config.max_position_embeddings), DEFAULT_MAX_SEQ_LEN)
    if config.max_position_embeddings < context:
        raise ConfigError(f"draft model {draft_dir} supports {config.max_position_embeddings} positions but the "
                          f"engine runs sequences of up to {context} tokens; lower max_seq_len or use another draft",
                          field="draft_model")
    if model.device.type == "cuda":
        plan_draft(settings, model.config, config, draft_dir, torch.cuda.mem_get_info(model.device)[0])
    draft = LlamaModel(config, load_weights(draft_dir, config), model.device)
    return DraftModel(draft, draft_tok, target_vocab=model.vocab_size, cache_type=settings.cache_type)

"""Hook specifications of the pluggy project "exl2_backend" (hook API version HOOK_API_VERSION).

A backend is a module (or object) with `@hookimpl` functions, advertised under the entry-point group
`exl2_backend.backends`. The per-engine hooks are `firstresult`: every backend returns None for a handle it
did not create, so a call reaches the backend that owns the handle. The contract, with threading rules and
error tiers, is in docs/hooks.md. No torch here: hosts import this module cheaply.
"""

from __future__ import annotations

import pluggy

from exl2_backend._version import HOOK_API_VERSION

PROJECT = "exl2_backend"
ENTRY_POINT_GROUP = "exl2_backend.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["ENTRY_POINT_GROUP", "HOOK_API_VERSION", "HOOK_NAMES", "PROJECT", "hookimpl", "hookspec"]


@hookspec
def exl2_capabilities() -> dict:
    """Describe the backend without loading anything: the same facts as its plugin_manifest.toml
    (name, version, hook_api_version, formats, architectures, devices, cache_types, attention_backends,
    hooks, ...). Not firstresult: the host gets one dict per installed backend."""


@hookspec(firstresult=True)
def exl2_load(settings: dict):
    """Load a model and return a `BackendHandle`, or None when these settings are not for this backend
    (`settings["backend"]` names another one). settings: `model_dir` (None = the backend's default model),
    `device`, `max_seq_len`, `cache_tokens`, `page_size`, `max_batch_size`, `max_chunk_size`, `cache_type`,
    optional `model_id` (the name hosts show); speculative decoding: `draft_model` (a directory),
    `num_speculative_tokens` (k, default 4), `ngram` (bool or {min_n, max_n}), `adaptive_speculation` — then
    `exl2_decode` drafts and verifies, adding one or more tokens per sequence per call. Raises
    `exl2_backend.errors.ConfigError` / `ModelFormatError` subclasses naming the field or file at fault."""


@hookspec(firstresult=True)
def exl2_prefill(handle, batch):
    """Admit `batch.new` and run the next prompt chunk of `batch.new` + `batch.seq_ids`; returns
    list[Event], one per sequence in the batch (new ones first, in order). A rejected request yields an
    event with finish_reason "error" and error=AdmissionRejected (tier 1); a sequence whose prompt completed
    carries its first token; the others carry prefill_remaining > 0."""


@hookspec(firstresult=True)
def exl2_decode(handle, batch):
    """One new token for every sequence in `batch.seq_ids` (all fully prefilled), batched in one forward;
    returns list[Event] in the same order."""


@hookspec(firstresult=True)
def exl2_draft_verify(handle, batch):
    """Score host-supplied drafts (`batch.drafts[seq_id]`, token ids proposed to follow the sequence) in one
    forward and accept them while the engine's own sampled token equals the draft (exact-match rule: greedy
    output is identical to plain decoding, sampled output keeps the model's distribution), then add one
    token. Returns list[Event] whose token_ids hold accepted drafts + 1 token and accepted_drafts."""


@hookspec(firstresult=True)
def exl2_release(handle, seq_ids: list):
    """Forget sequences and free their KV pages (the cancellation path; idempotent, unknown ids ignored).
    Returns list[Event]: a final "cancelled" event for each sequence that was still running."""


@hookspec(firstresult=True)
def exl2_stats(handle) -> dict:
    """Live figures of a loaded engine: pages (total/free/reserved), free_tokens, running sequences, ..."""


@hookspec(firstresult=True)
def exl2_unload(handle):
    """Release every sequence and drop the engine's memory. Returns True."""


HOOK_NAMES = ("exl2_capabilities", "exl2_load", "exl2_prefill", "exl2_decode", "exl2_draft_verify",
              "exl2_release", "exl2_stats", "exl2_unload")

"""The plugin contract: hookspecs, types, manifest vs pyproject vs capabilities, entry-point discovery,
per-plugin error isolation, and torch-free imports of the plugin modules."""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pluggy
import pytest
import tomllib

from exl2_backend._version import HOOK_API_VERSION, __version__
from exl2_backend.plugin import hookspecs, impl
from exl2_backend.plugin.manager import get_plugin_manager, new_plugin_manager, plugin_failures, reset_plugin_manager
from exl2_backend.plugin.manifest import read_manifest
from exl2_backend.plugin.types import (
    AdmissionRejected,
    EngineUnhealthy,
    Event,
    SequenceFailed,
    SequenceRequest,
    StepBatch,
)

ROOT = Path(__file__).resolve().parents[2]
PER_ENGINE_HOOKS = ("exl2_load", "exl2_prefill", "exl2_decode", "exl2_draft_verify", "exl2_release", "exl2_stats",
                    "exl2_unload")


# --- hookspecs ------------------------------------------------------------------------------------------------


def _spec_opts(name):
    return getattr(hookspecs, name).exl2_backend_spec


def test_hookspec_names_and_flags():
    specced = {n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(f, "exl2_backend_spec")}
    assert specced == set(hookspecs.HOOK_NAMES)
    for name in PER_ENGINE_HOOKS:
        assert _spec_opts(name)["firstresult"], f"{name} must be firstresult (one backend answers per handle)"
    assert not _spec_opts("exl2_capabilities")["firstresult"], "every backend reports its capabilities"
    assert hookspecs.PROJECT == "exl2_backend" and hookspecs.ENTRY_POINT_GROUP == "exl2_backend.backends"


def test_impl_matches_specs():
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(impl, name="exl2")  # argument names are validated against the specs here
    pm.check_pending()  # no impl of an unknown hook
    implemented = {c.name for c in pm.get_hookcallers(impl)}
    assert implemented == set(hookspecs.HOOK_NAMES)


def test_per_engine_hooks_ignore_foreign_handles():
    """A handle the backend did not create gets None, so pluggy moves on to the backend that owns it."""
    pm = new_plugin_manager(load_entrypoints=False, builtin_fallback=True)

    class Other:
        pass

    class OtherBackend:
        @hookspecs.hookimpl
        def exl2_decode(self, handle, batch):
            return ["other"] if isinstance(handle, Other) else None

    pm.register(OtherBackend(), name="other")
    assert pm.hook.exl2_decode(handle=Other(), batch=StepBatch(seq_ids=["x"])) == ["other"]
    assert pm.hook.exl2_load(settings={"backend": "someone-else"}) is None


# --- types ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.5), ("repetition_penalty", 0),
    ("frequency_penalty", 3.0), ("presence_penalty", -3.0), ("max_new_tokens", 0), ("seed", -1),
    ("stop", [""]), ("stop_token_ids", [-2]),
    ("ignore_eos", "no"), ("add_generation_prompt", 1),  # only real booleans: "no" is truthy
    ("logprobs", -1), ("logprobs", 21), ("logprobs", True), ("logprobs", 2.5),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {3: 200}), ("logit_bias", {"3": 1}), ("logit_bias", [3]),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", False),
    ("grammar", "json"), ("grammar", {"type": "yaml"}), ("grammar", {"type": "regex"}),
    ("grammar", {"type": "choice", "value": []}), ("grammar", {"type": "json_object", "schema": {}}),
    ("tools", "get_weather"), ("tools", [{"type": "function"}]),
    ("continue_final_message", True), ("continue_final_message", "yes"),  # True: a prompt, not messages
    ("min_new_tokens", -1), ("min_new_tokens", 300), ("min_new_tokens", True),  # 300 > max_new_tokens (256)
    ("tools", [{"type": "function", "function": {"name": "f"}}]),  # tools go with chat messages, not a prompt
    ("chat_template_kwargs", {"date_string": "x"}),  # chat messages only, not a prompt
    ("chat_template_kwargs", ["date_string"]),
])
def test_request_validation_names_the_field(field, value):
    req = SequenceRequest("s", prompt="hi", **{field: value})
    with pytest.raises(AdmissionRejected) as ei:
        req.validate()
    assert ei.value.field == field and ei.value.reason == "invalid_request" and ei.value.tier == 1
    assert field in str(ei.value)


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"tools": []}, {"eos_token": ""}, {"a b": 1},
                                    {f"v{i}": i for i in range(33)}])
def test_chat_template_kwargs_names_the_renderer_sets_are_refused(kwargs):
    req = SequenceRequest("s", messages=[{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs)
    with pytest.raises(AdmissionRejected) as ei:
        req.validate()
    assert ei.value.field == "chat_template_kwargs"
    SequenceRequest("s", messages=[{"role": "user", "content": "hi"}],
                    chat_template_kwargs={"date_string": "26 Jul 2024", "enable_thinking": False}).validate()


def test_request_needs_exactly_one_prompt_form():
    SequenceRequest("s", prompt_ids=[1, 2]).validate()
    for kwargs in ({}, {"prompt": "a", "prompt_ids": [1]}, {"messages": []}):
        with pytest.raises(AdmissionRejected):
            SequenceRequest("s", **kwargs).validate()


def test_errors_tiers_and_pickling():
    a = AdmissionRejected("too long", reason="prompt_too_long", field="prompt", limit=512, length=600, seq_id="x")
    b = SequenceFailed("nan", seq_id="y")
    c = EngineUnhealthy("cuda fault")
    assert (a.tier, b.tier, c.tier) == (1, 2, 3)
    for err in (a, b, c):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.to_dict() == err.to_dict()
    assert a.to_dict()["limit"] == 512


def test_event_and_batch_basics():
    assert not Event("a").finished and Event("a", finish_reason="length").finished
    assert StepBatch(drafts={"a": [1], "b": []}).ids() == ["a", "b"]
    assert StepBatch(seq_ids=["b"], drafts={"a": [1]}).ids() == ["b"]


# --- manifest, pyproject, capabilities ------------------------------------------------------------------------


def test_manifest_matches_package_and_capabilities():
    m = read_manifest(ROOT / "plugin_manifest.toml")
    assert m["version"] == __version__
    assert m["hook_api_version"] == HOOK_API_VERSION
    assert m["hooks"] == list(hookspecs.HOOK_NAMES)
    caps = impl.exl2_capabilities()
    for key in ("name", "version", "hook_api_version", "formats", "architectures", "devices", "cache_types",
                "attention_backends", "hooks"):
        assert caps[key] == m[key], key
    for key, value in m["capabilities"].items():
        assert caps[key] == value, key
    assert caps["threading"] == m["process"]["threading"]


def test_manifest_facts_match_the_engine():
    from exl2_backend.format.config import SUPPORTED_ARCHITECTURES
    from exl2_backend.runtime.settings import CACHE_TYPES

    m = read_manifest(ROOT / "plugin_manifest.toml")
    assert m["architectures"] == list(SUPPORTED_ARCHITECTURES)
    assert m["cache_types"] == list(CACHE_TYPES)


def test_manifest_entry_points_match_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = {(group, name, value) for group, eps in pyproject["project"]["entry-points"].items()
                for name, value in eps.items() if group.startswith("exl2_backend.")}
    m = read_manifest(ROOT / "plugin_manifest.toml")
    listed = {(ep["group"], ep["name"], ep["module"]) for ep in m["entry_points"]}
    assert listed == {d for d in declared if d[0] == hookspecs.ENTRY_POINT_GROUP}
    for _, _, module in listed:
        assert module.split(":")[0] in sys.modules or __import__(module)


def test_default_manifest_location_is_found():
    assert read_manifest()["name"] == "exl2_backend"


# --- entry-point discovery (needs `pip install -e .`) ---------------------------------------------------------


def _installed_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP) if ep.name == "exl2"]
    if not eps:
        pytest.fail("exl2_backend is not installed, so its entry point is invisible: run `pip install -e .`")
    return eps[0]


def test_entry_point_is_installed():
    ep = _installed_entry_point()
    assert ep.value == "exl2_backend.plugin.impl"
    assert ep.dist is not None and ep.dist.name.replace("-", "_") == "exl2_backend"


def test_discovery_through_entry_point_only():
    _installed_entry_point()
    pm = new_plugin_manager()  # no built-in fallback: the entry point must provide the backend
    assert pm.get_plugin("exl2") is impl
    assert any(dist.project_name.replace("-", "_") == "exl2_backend" for _, dist in pm.list_plugin_distinfo())
    caps = pm.hook.exl2_capabilities()
    assert [c["name"] for c in caps] == ["exl2_backend"]


def test_manager_is_loaded_once():
    reset_plugin_manager()
    try:
        assert get_plugin_manager(builtin_fallback=True) is get_plugin_manager()
    finally:
        reset_plugin_manager()


def test_broken_plugins_are_isolated(tmp_path, monkeypatch, caplog):
    """One plugin that fails to import and one that implements an unknown hook are skipped with a log line;
    the real backend still loads."""
    (tmp_path / "exl2_bad_hook_plugin.py").write_text(textwrap.dedent("""
        import pluggy
        hookimpl = pluggy.HookimplMarker("exl2_backend")

        @hookimpl
        def exl2_not_a_hook():
            return 1
    """))
    dist = tmp_path / "exl2_fake_plugins-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: exl2-fake-plugins\nVersion: 0.0.1\n")
    (dist / "entry_points.txt").write_text("[exl2_backend.backends]\nbroken = exl2_no_such_module_xyz\n"
                                           "badhook = exl2_bad_hook_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_plugin_manager()
    try:
        with caplog.at_level(logging.WARNING, logger="exl2_backend.plugin"):
            pm = get_plugin_manager(builtin_fallback=True)
        assert pm.has_plugin("exl2")
        assert not pm.has_plugin("broken") and not pm.has_plugin("badhook")
        assert set(plugin_failures()) == {"broken", "badhook"}
        assert "exl2_no_such_module_xyz" in caplog.text and "exl2_not_a_hook" in caplog.text
        assert pm.hook.exl2_capabilities()[0]["name"] == "exl2_backend"
    finally:
        reset_plugin_manager()
        sys.modules.pop("exl2_bad_hook_plugin", None)


# --- no torch at import ---------------------------------------------------------------------------------------

_NO_TORCH = textwrap.dedent("""
    import importlib.abc, sys

    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (imported: {name})")
            return None

    sys.meta_path.insert(0, _Block())
    import exl2_backend.plugin
    import exl2_backend.plugin.hookspecs, exl2_backend.plugin.types, exl2_backend.plugin.impl
    import exl2_backend.plugin.manager, exl2_backend.plugin.manifest
    import exl2_backend.serve.schemas
    from exl2_backend.plugin import new_plugin_manager, read_manifest, SequenceRequest
    pm = new_plugin_manager(builtin_fallback=True)
    caps = pm.hook.exl2_capabilities()
    assert caps and caps[0]["formats"] == ["exl2"], caps
    assert read_manifest()["name"] == "exl2_backend"
    SequenceRequest("a", prompt="x").validate()
    assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
    print("ok")
""")


def test_plugin_modules_import_without_torch():
    r = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr

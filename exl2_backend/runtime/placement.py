"""Engine.load's model construction: plan the memory (plan/vram.py) and refuse a plan that does not fit before
anything is allocated, then build the model the plan describes -- on one device, as a layer split over
several (model/split.py), or as tensor-parallel ranks (model/tensor_parallel.py, runtime/tp_group.py).
"""

from __future__ import annotations

import logging

from exl2_backend.plan import plan_load

log = logging.getLogger("exl2_backend")


def load_model(settings):
    """-> (model, settings). For a split or tensor-parallel load the returned settings carry the plan's
    max_seq_len and cache_tokens (sized over all devices); a single-device load keeps the engine's own
    sizing from the free memory after the weights."""
    from exl2_backend.runtime.settings import require_device

    require_device(settings.device)  # a device that is not here: ConfigError before any planning
    plan = plan_load(settings)
    plan.check()
    for d in plan.devices:
        log.info("exl2_backend: plan %s layers %s: weights %.2f GB, KV %.2f GB, scratch %.2f GB, peak %.2f GB of %s",
                 d.device, d.layers, d.weights / 1e9, d.kv_cache / 1e9, d.scratch / 1e9, d.peak / 1e9,
                 "unchecked" if d.capacity is None else f"{d.capacity / 1e9:.2f} GB ({d.capacity_source})")
    if plan.mode == "split":
        from exl2_backend.model.split import SplitLlamaModel, segments_from_plan

        model = SplitLlamaModel.from_dir(settings.model_dir, segments_from_plan(plan))
    elif plan.mode == "tensor_parallel":
        from exl2_backend.model.weight_source import DirSource
        from exl2_backend.runtime.tp_group import launch_tensor_parallel

        model = launch_tensor_parallel(DirSource(str(settings.model_dir)), plan.tensor_parallel,
                                       settings.torch_device.type)
    else:
        from exl2_backend.model import LlamaModel

        model = LlamaModel.from_dir(settings.model_dir, settings.torch_device)
    model.plan = plan
    if plan.mode != "single":
        settings = settings.model_copy(update={"max_seq_len": plan.max_seq_len, "cache_tokens": plan.cache_tokens})
    return model, settings

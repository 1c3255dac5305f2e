"""Memory planning before a load: per-device sizes of weights, KV cache, draft, scratch (plan/vram.py), from
header-only model descriptions (plan/sizes.py)."""

from exl2_backend.plan.sizes import LinearDesc, ModelDesc, describe_dir, describe_random  # noqa: F401
from exl2_backend.plan.vram import DevicePlan, VramPlan, plan_devices, plan_load  # noqa: F401

"""Which GEMV of a decode step costs what past its bytes (used by scripts/profile_decode.py).

Every small-M GEMV launch has the same kernel name, so a profile's critical path sums q/k/v, o, gate/up, down and
the head together. In a decode step they launch in a fixed order (per layer q/k/v, o, gate/up, down; then the
head), so the n-th GEMV launch of a step has a known role. These functions label the launches by role and compare
each role's critical-path time with the time its weight bytes take at a read bandwidth: what a launch of that
role adds past streaming. Plain Python (no GPU), so they are unit-tested (tests/unit/test_gemv_roles.py).
"""

from __future__ import annotations

GEMV_KERNEL_PREFIX = "gemv_tma_kernel"
LAYER_ROLES = ("q/k/v", "o", "gate/up", "down")


def step_roles(num_layers: int, head: bool) -> list[str]:
    """The roles of one decode step's GEMV launches, in launch order."""
    return list(LAYER_ROLES) * num_layers + (["head"] if head else [])


def label_gemv_roles(events: list[tuple[float, float, str]], roles: list[str],
                     prefix: str = GEMV_KERNEL_PREFIX) -> list[tuple[float, float, str]]:
    """(start, end, name) device events -> the same with each GEMV launch (name starting with `prefix`) renamed
    "name [role]", roles taken cyclically in start order. Unchanged when the GEMV count is not a whole number of
    steps (another launch order than `roles` assumes)."""
    order = sorted(range(len(events)), key=lambda i: events[i][0])
    gemvs = [i for i in order if events[i][2].startswith(prefix)]
    if not roles or not gemvs or len(gemvs) % len(roles):
        return list(events)
    out = list(events)
    for n, i in enumerate(gemvs):
        start, end, name = events[i]
        out[i] = (start, end, f"{name} [{roles[n % len(roles)]}]")
    return out


def role_rows(critical: dict[str, list[float]], role_bytes: dict[str, int], bandwidth_gbs: float) -> list[dict]:
    """Per role: launches and critical-path us per step (from critical_path's {name: [count, us]}), us per launch,
    MB per launch, the us its bytes take at `bandwidth_gbs`, and the us past that per launch."""
    rows = []
    for name, (count, us) in critical.items():
        if not name.endswith("]") or " [" not in name:
            continue
        role = name[name.rindex(" [") + 2 : -1]
        if role not in role_bytes or count <= 0:
            continue
        mb = role_bytes[role] / count / 1e6  # per launch
        stream_us = role_bytes[role] / count / (bandwidth_gbs * 1e3)  # bytes / (GB/s) in us
        rows.append({"role": role, "launches": count, "us_per_step": us, "us_per_launch": us / count,
                     "mb_per_launch": mb, "stream_us_per_launch": stream_us,
                     "past_stream_us_per_launch": us / count - stream_us})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def print_role_rows(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    print(f"{'role':10s} {'n/step':>7s} {'us/step':>9s} {'us/launch':>10s} {'MB/launch':>10s} {'stream us':>10s} "
          f"{'past us':>8s}")
    for r in rows:
        print(f"{r['role']:10s} {r['launches']:7.1f} {r['us_per_step']:9.1f} {r['us_per_launch']:10.2f} "
              f"{r['mb_per_launch']:10.2f} {r['stream_us_per_launch']:10.2f} {r['past_stream_us_per_launch']:8.2f}")

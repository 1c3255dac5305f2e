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


def step_roles(num_layers: int, head: bool, by_layer: bool = False) -> list[str]:
    """The roles of one decode step's GEMV launches, in launch order; `by_layer` tags each with its layer
    ("gate/up#3"), which role_rows sums away and kind_rows groups by."""
    roles = [f"{r}#{i}" if by_layer else r for i in range(num_layers) for r in LAYER_ROLES]
    return roles + (["head"] if head else [])


def split_label(label: str) -> tuple[str, int | None]:
    """"gate/up#3" -> ("gate/up", 3); "head" -> ("head", None)."""
    role, _, layer = label.partition("#")
    return role, int(layer) if layer else None


def _labelled(critical: dict[str, list[float]]):
    """(role, layer, count, us) of every role-labelled entry of a critical path."""
    for name, (count, us) in critical.items():
        if name.endswith("]") and " [" in name and count > 0:
            role, layer = split_label(name[name.rindex(" [") + 2 : -1])
            yield role, layer, count, us


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


def _row(role: str, count: float, us: float, nbytes: float, bandwidth_gbs: float) -> dict:
    mb = nbytes / count / 1e6  # per launch
    stream_us = nbytes / count / (bandwidth_gbs * 1e3)  # bytes / (GB/s) in us
    return {"role": role, "launches": count, "us_per_step": us, "us_per_launch": us / count, "mb_per_launch": mb,
            "stream_us_per_launch": stream_us, "past_stream_us_per_launch": us / count - stream_us}


def role_rows(critical: dict[str, list[float]], role_bytes: dict[str, int], bandwidth_gbs: float) -> list[dict]:
    """Per role (layers summed): launches and critical-path us per step (from critical_path's {name: [count,
    us]}), us per launch, MB per launch, the us its bytes take at `bandwidth_gbs`, and the us past that per
    launch."""
    sums: dict[str, list[float]] = {}
    for role, _, count, us in _labelled(critical):
        if role in role_bytes:
            s = sums.setdefault(role, [0.0, 0.0])
            s[0] += count
            s[1] += us
    rows = [_row(role, count, us, role_bytes[role], bandwidth_gbs) for role, (count, us) in sums.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def kind_rows(critical: dict[str, list[float]], launch_bytes: dict[tuple[str, int], int],
              kinds: dict[tuple[str, int], str], bandwidth_gbs: float) -> list[dict]:
    """Per (role, kind) over the layers whose launch of that role has that kind (kinds[(role, layer)], e.g. its
    bit widths): the same columns as role_rows, from a critical path labelled by layer; bytes per launch from
    launch_bytes[(role, layer)]. Tells which layers' GEMVs of one role carry the time past streaming."""
    sums: dict[tuple[str, str], list[float]] = {}
    for role, layer, count, us in _labelled(critical):
        if layer is None or (role, layer) not in kinds:
            continue
        s = sums.setdefault((role, kinds[(role, layer)]), [0.0, 0.0, 0.0])
        s[0] += count
        s[1] += us
        s[2] += launch_bytes[(role, layer)] * count
    rows = [{**_row(role, count, us, nbytes, bandwidth_gbs), "kind": kind}
            for (role, kind), (count, us, nbytes) in sums.items()]
    return sorted(rows, key=lambda r: (r["role"], -r["us_per_launch"]))


def print_role_rows(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    print(f"{'role':10s} {'kind':28s} {'n/step':>7s} {'us/step':>9s} {'us/launch':>10s} {'MB/launch':>10s} "
          f"{'stream us':>10s} {'past us':>8s}")
    for r in rows:
        print(f"{r['role']:10s} {r.get('kind', ''):28s} {r['launches']:7.1f} {r['us_per_step']:9.1f} "
              f"{r['us_per_launch']:10.2f} {r['mb_per_launch']:10.2f} {r['stream_us_per_launch']:10.2f} "
              f"{r['past_stream_us_per_launch']:8.2f}")

#!/usr/bin/env bash
# RAN in session 52 (H100, 197 s): suite 2,362 passed; the stored-order norm lost (k = 4 verify 1.326 / 1.318 against
# 1.234 / 1.244) and is removed (9f6381a). docs/performance.md, session 52. Its library and routing switches are gone
# from the tree: to rerun it, check out 6b58ac9 (this script as it ran, the csrc it built, common.sh's
# norm_variant_costs).
# Device call BP1 (session 52; carry .whl and .dev: this csrc's library (D) and session 48's (O, .dev/libO.so.gz,
# built from a95bbfd by `prepare_carry.sh --baseline a95bbfd` and renamed); BP1_LIMIT seconds (480)). BO3 shortened:
# the stored-order norm (kFNormLaunch, session 51) for the first time on a GPU in its final form.
#  1. the whole GPU suite that needs no SmolLM2 (its GEMV tests: both norm forms bit-identical with add_rms_norm +
#     GEMV, the model forward at 5 rows);
#  2. spec_bench step costs interleaved twice: O = session 48's library with its routing (EXL2_BACKEND_NORM_MAX_ROWS=2)
#     and P = this library with the stored-order norm up to eight rows (EXL2_BACKEND_NORM_STORED=1
#     EXL2_BACKEND_FUSED_NORM_PASSES=2: k = 2 and k = 4 verifies fused). BO3's D (up to four rows) is left out: its
#     k <= 2 routing is P's and its k = 4 is O's norm launch;
#  3. P's steps by role (spec_bench --kernels).
echo "call BP1 measured 6b58ac9's csrc: git checkout 6b58ac9 and run scripts/device/call_BP1.sh there" >&2
exit 2

#!/usr/bin/env bash
# Its library is gone from the tree: to rerun it, check out ddb94e0 (this script as it ran, and the csrc it built).
# RAN in session 51 (H100): the first form (one stored-order norm for every M) made the decode step 2.73 ms against
# 2.30: its per-value stores branched around reloads of spilled weights (~7 us per fused launch); replaced (BO3).
# Device call BO1 (session 51; carry .whl and .dev: this csrc's library (D) and session 48's (O, .dev/libO.so.gz);
# BO1_LIMIT seconds (560)): the norm inside the GEMV without its M x K rows in shared memory. Until now every block
# of a norm-fused GEMV kept all M normalized rows (40 KB at M = 5, K = 4096) beside its ring and input rows, which
# left one block per SM for the head and gate/up at M = 5 (BN1: gate/up 51.2 us fused against 25.6 + 3.7, the head
# 224 against 146); the new kernel stores each block's split straight into its stored-order input through an inverse
# row map (K uint16), two rows per thread and pass (M <= 4 in one pass at K = 4096).
#  1. the GEMV GPU tests (bit-identity of the fused norm with add_rms_norm + GEMV, every width, M over passes);
#  2. spec_bench step costs interleaved twice: O = session 48's library with its routing (the fused norm up to two
#     rows: EXL2_BACKEND_NORM_MAX_ROWS=2), D = the new library's default (fused up to four rows, one pass),
#     P = the new library fusing up to eight rows (EXL2_BACKEND_FUSED_NORM_PASSES=2: the k = 4 verify fused);
#  3. P's k = 4 verify by role (spec_bench --kernels), if time is left.
echo "call BO1 measured ddb94e0's csrc: git checkout ddb94e0 and run scripts/device/call_BO1.sh there" >&2
exit 2

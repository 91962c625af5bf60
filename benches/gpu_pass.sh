#!/usr/bin/env bash
# One GPU pass per machine kind, each meant for one device call (GPU.md: batch the work).
# Run on the GPU machine from the repo root, with the library built here for its torch 2.11
# (`make gpu-lib`) and carried: build/torch2.11/_C.so (or torch_ops/sched_lifetime/_C.so). Every
# step has its own timeout and log under OUT; a failing step does not stop the others; the last
# lines of each log are printed at the end.
#   bash benches/gpu_pass.sh one OUT    # nvidia-h200: cuda tests, the Pager's A/B, host overhead
#   bash benches/gpu_pass.sh one2 OUT   # nvidia-h200: page nodes, long context, compile paging, the family's shapes
#   bash benches/gpu_pass.sh two OUT    # nvidia-h200-x2: main job A/B (incl. ours+ep2, the old EP budget), GraphStep A/B
#   bash benches/gpu_pass.sh two2 OUT   # nvidia-h200-x2: DualPipeV handler A/B (EP local), ours vs ours+search
#   bash benches/gpu_pass.sh cuda2 OUT  # nvidia-h200-x2: the whole cuda suite (1- and 2-GPU tests), host overhead
#   bash benches/gpu_pass.sh explain OUT  # one H200: timed paging, eager and compiled, with Rust's reasons per tensor
#   bash benches/gpu_pass.sh capture OUT  # one H200: whole-step graph pools, page nodes captured, min_cut, host overhead
#   bash benches/gpu_pass.sh link2 OUT  # nvidia-h200: issue 28's analysis: cuda suite, link rate, main job on the link with
#                                       # 5 profiled steps per arm and durations.json
#   bash benches/gpu_pass.sh four OUT   # nvidia-h200-x4: DualPipeV as PP=2 x EP=2, handler vs none
#   bash benches/gpu_pass.sh twopage OUT  # nvidia-h200-x2: EP + page nodes, ours vs ours+page at 3 budgets
#   bash benches/gpu_pass.sh hf OUT     # nvidia-h200: third-party models (transformers, issue 27): paging default vs off
#                                       # vs save_on_cpu, aot_eager vs ours (Qwen3-MoE at 8192 tokens, DeepSeek-V3 at 4096)
#   bash benches/gpu_pass.sh link OUT   # nvidia-h200: EP=8 on the emulated link (one GPU, issue 28): its rate,
#                                       # the main job's arms with ours+page, GraphStep vs compiled, its cuda tests
#   bash benches/gpu_pass.sh calib OUT  # nvidia-h200: measured costs (issue 31): the calibrated order's cuda test,
#                                       # the family's shapes with the calibrated arm, the main job on the link
#   bash benches/gpu_pass.sh calibl OUT # nvidia-h200: issues 31, 28 and 35: calibrated test, family, main job on the link
#   bash benches/gpu_pass.sh final OUT  # nvidia-h200: calibl's steps and the HF Qwen3-MoE paging A/B, in one call
#   bash benches/gpu_pass.sh hfdet OUT  # nvidia-h200: issue 27's GPU parity under strict determinism (Qwen3-MoE,
#                                       # DeepSeek-V3, all arms incl. cudagraphs), a profiled step per arm, two page streams
#   bash benches/gpu_pass.sh hftrace OUT  # nvidia-h200: where paging's time goes on HF models (fast attention), traces
#   bash benches/gpu_pass.sh s4 OUT     # nvidia-h200: paging on a GPU-bound HF config and at 16384 tokens (issue 27),
#                                       # one vs two page streams at 65536 tokens (issue 32)
#   bash benches/gpu_pass.sh calib2 OUT # nvidia-h200-x2: the main job over NCCL, ours vs calibrated
set -uo pipefail
mode=${1:?usage: benches/gpu_pass.sh one|one2|two|two2|cuda2|explain|capture|four|twopage|link|link2|page2|page3|calib|calibl|calib2|hf|hfdet|hftrace|hftrace2|hfmin|hfpy|gscal|s4|s4b|s4c|s4d|s4e|s4f|s4g|s4h|s5a|s5b|s5c|s5d|s5e|s6a|s6b|s6c|s6d|s7a|s7b|s7c|s7d|s7e|s8a|s8b|s8c|s9a|s9b|s9c|s9d|s10a|s10b|s10c|s10d|s11a|s11b|s11c|s12a|s13a|s13b|s13c|s13d|s13f|s14a|s14b|s14c|final OUT}
out=${2:?usage: benches/gpu_pass.sh one|one2|two|two2|cuda2|explain|capture|four|twopage|link|link2|page2|page3|calib|calibl|calib2|hf|hfdet|hftrace|hftrace2|hfmin|hfpy|gscal|s4|s4b|s4c|s4d|s4e|s4f|s4g|s4h|s5a|s5b|s5c|s5d|s5e|s6a|s6b|s6c|s6d|s7a|s7b|s7c|s7d|s7e|s8a|s8b|s8c|s9a|s9b|s9c|s9d|s10a|s10b|s10c|s10d|s11a|s11b|s11c|s12a|s13a|s13b|s13c|s13d|s13f|s14a|s14b|s14c|final OUT}
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here/torch_ops${PYTHONPATH:+:$PYTHONPATH}"
# The library built for this machine's torch 2.11 (`make gpu-lib`), when carried.
if [ -f "$here/build/torch2.11/_C.so" ] && [ -z "${SCHED_LIFETIME_LIB:-}" ]; then
    export SCHED_LIFETIME_LIB="$here/build/torch2.11/_C.so"
fi
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
py=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...
    local name=$1 secs=$2
    shift 2
    echo "== $name" >&2
    timeout "$secs" "$@" > "$out/$name.log" 2>&1
    echo "rc=$?" >> "$out/$name.log"
}
qwen_big() {  # qwen_big NAME PAGING_JSON: the GPU-bound Qwen3-MoE config (1021M, 8192 tokens, fast attention), compiled vs paging
    step hf_qwen_big_$1 75 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms compiled,paging --paging "$2" --out "$out/hf_qwen_big_$1.json"
}
qwen_rounds() {  # qwen_rounds NAME PAGING_JSON [ARMS]: qwen_big's A/B with the arms (compiled,paging) alternating over 3 rounds
    step hf_qwen_rounds_$1 300 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --rounds 3 --determinism warn \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms "${3:-compiled,paging}" --paging "$2" --out "$out/hf_qwen_rounds_$1.json"
}
qwen_ab() {  # qwen_ab NAME SECS ROUNDS ARMS PAGING_JSON [MORE ARGS]: qwen_big's config, the arms alternating over ROUNDS rounds
    local name=$1 secs=$2 rounds=$3 arms=$4 paging=$5
    shift 5
    step "$name" "$secs" "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --rounds "$rounds" --determinism warn \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms "$arms" --paging "$paging" --out "$out/$name.json" "$@"
}
qwen_group4() {  # qwen_group4 SECS [MORE ARGS]: qwen_ab over 2 rounds at budget 1.0 / slack 1.1, group 1 (paging) vs 4 (paging_b)
    local secs=$1
    shift
    qwen_ab hf_qwen_rounds_g4 "$secs" 2 compiled,paging,paging_b '{"paging_budget": 1.0, "paging_slack": 1.1}' \
        --paging-b '{"paging_group_out": 4}' "$@"
}
pitched_ab() {  # pitched_ab NAME: compiled, paging, paging_gather at budget 1.0 / slack 1.1, 3 rounds, a traced step per arm;
    # the idle split, and the paged traces' kernels against the compiled one's (trace_stalls.py --kernels-vs)
    qwen_ab "$1" 300 3 compiled,paging,paging_gather '{"paging_budget": 1.0, "paging_slack": 1.1}' --profile --trace "$out/traces"
    step stalls 60 "$py" benches/trace_stalls.py "$out"/traces/*.json
    step kernels 60 "$py" benches/trace_stalls.py --kernels-vs "$out/traces/qwen3_moe_compiled.json" "$out/traces/qwen3_moe_paging.json" \
        "$out/traces/qwen3_moe_paging_gather.json"
    rm -rf "$out/traces"
}
hf_gpu_matrix() {  # hf_gpu_matrix SECS: test_hf_models.py's GPU matrix, one pytest per model at once
    local m
    for m in deepseek_v3 granitemoe llama mixtral olmoe qwen2_moe qwen3_moe; do
        step "hf_cuda_$m" "$1" "$py" -m pytest -q -rs -m cuda -p no:logging -p no:cacheprovider tests/python/test_hf_models.py \
            -k "on_the_gpu and $m" &
    done
    wait
}
hf_gpu_parity() {  # the tiny HF matrix on the GPU one case after another, then DeepSeek-V3 463M's strict parity at 4096 tokens
    step hf_models_cuda 300 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_hf_models.py
    step hf_ds_strict 200 "$py" benches/hf_paging_ab.py --model deepseek_v3 --seq 4096 --steps 3 --rounds 1 \
        --arms aot_eager,compiled,cudagraphs,paging --paging '{"paging_budget": 1.0, "paging_slack": 1.05}' --out "$out/hf_ds_strict.json"
}
paging_8k() {  # the eager Pager at 8192 tokens: off, one page stream (slack 1.25, 1.0), two, save_on_cpu
    step paging_8k 200 "$py" benches/paging_ab.py --config h200 --steps 5 \
        --arms off,1s-timed:1.0,1s-timed:1.0:1.0,timed:1.0,save_on_cpu --json "$out/paging_8k.json"
}
case "$mode" in
s11a)
    # Issue 27: where the paged step's extra GPU time goes, and the pitched page copy (a saved
    # slice with gaps, the experts' gate and up halves, moved by the copy engine alone: no gather
    # or scatter kernel, no device temporary). The paging cuda tests (pitched ones included);
    # the Qwen3-MoE A/B at budget 1.0 / slack 1.1, compiled, paging (pitched copies, the
    # default), paging_gather (torch's copy_: the default before), 3 rounds, one profiled and
    # traced step per arm after the last: the compute stream's idle time split, and each paged
    # trace's kernels against the compiled one's (benches/trace_stalls.py --kernels-vs).
    export PYTHONUNBUFFERED=1
    step paging_cuda 120 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_paging_pitched.py tests/python/test_paging_pool.py \
        tests/python/test_paging_pager.py tests/python/test_paging_groups.py tests/python/test_compile.py -k "paging or pool or pager or page or pitched or group"
    pitched_ab hf_qwen_rounds_s11
    ;;
s11b)
    # Issue 27: s11a's A/B again after page-ins stopped allocating filled tensors under
    # deterministic algorithms (`paging.pool.empty_unfilled`: s11a's kernels.log showed a fill kernel
    # per page-in on the compute stream), with the pool's cuda tests first.
    export PYTHONUNBUFFERED=1
    step paging_cuda 60 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_paging_pitched.py tests/python/test_paging_pool.py
    pitched_ab hf_qwen_rounds_s11b
    ;;
s12a)
    # Issue 27's parity on the GPU with this session's paging (pitched copies, unfilled page-ins):
    # the tiny Hugging Face matrix on the GPU (every model x experts implementation; our backend,
    # CUDA graphs, timed and static paging against aot_eager, strict determinism), then the
    # DeepSeek-V3 463M A/B's parity at 4096 tokens (strict).
    export PYTHONUNBUFFERED=1
    hf_gpu_parity
    ;;
s13a)
    # Issue 27's last checks, one call: the pool's and pitched copies' cuda tests after the second
    # review's fixes (packed host layout only where a pitched copy moves it, unfilled page-ins from
    # a storage of the extent, the pool's end), then s12a (the tiny Hugging Face matrix on the GPU;
    # DeepSeek-V3 463M's strict parity at 4096 tokens).
    export PYTHONUNBUFFERED=1
    step paging_cuda 60 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_paging_pitched.py tests/python/test_paging_pool.py
    hf_gpu_parity
    ;;
s13b)
    # Issue 32's 8192-token A/B with unfilled page-ins and pitched copies (the embedded model's
    # fused q/k/v and gate/up slices), off / one stream / two streams / save_on_cpu in one run, then
    # issue 27's Qwen3-MoE A/B (s11c's: compiled, paging, paging_gather) after the reviews' fixes.
    export PYTHONUNBUFFERED=1
    paging_8k
    qwen_ab hf_qwen_rounds_s13b 300 3 compiled,paging,paging_gather '{"paging_budget": 1.0, "paging_slack": 1.05}'
    ;;
s13c)
    # Issue 27's GPU parity after s13a: cudagraphs=True under dynamic shapes (s13a's tiny matrix
    # failed its cudagraphs arm on every eager-experts case: recordings keyed on compile-time
    # symbols), then the whole tiny Hugging Face matrix, one process per model at once (s13a ran
    # them one after another and ran out of time after 6 of 13 cases).
    export PYTHONUNBUFFERED=1
    step compile_cudagraphs 120 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_compile.py -k cudagraphs
    hf_gpu_matrix 300
    ;;
s13d)
    # Issue 32's 8192-token A/B again after link_rates keeps the fastest of its timed copies: s13b's
    # calibration measured 28.4 / 31.3 GB/s (the same run's 1 GiB copies: 55.1) and planned with
    # it; the plan's cuda tests first.
    export PYTHONUNBUFFERED=1
    step paging_plan_cuda 60 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_paging_plan.py
    paging_8k
    ;;
s13f)
    # After cudagraphs=True reads parameters in place (static_input_indices) and link_rates queues
    # its both-ways rounds: the cudagraphs and plan cuda tests, the link's rates, the tiny HF matrix
    # (one pytest per model at once), DeepSeek-V3 463M's aot_eager / compiled / cudagraphs (strict).
    export PYTHONUNBUFFERED=1
    step compile_cudagraphs 120 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_compile.py tests/python/test_paging_plan.py \
        -k "cudagraphs or measure or calibration"
    step link_rates 60 "$py" -c "import torch, sched_lifetime.paging as p; d = torch.device('cuda')
for mib in (64, 1024): r = p.link_rates(d, mib=mib); print(mib, 'MiB: d2h %.1f h2d %.1f both %.1f GB/s' % (r.d2h / 1e3, r.h2d / 1e3, r.both / 1e3))"
    hf_gpu_matrix 220
    step hf_ds_cudagraphs 150 "$py" benches/hf_paging_ab.py --model deepseek_v3 --seq 4096 --steps 3 --rounds 1 \
        --arms aot_eager,compiled,cudagraphs --out "$out/hf_ds_cudagraphs.json"
    ;;
s14a)
    # Prepared for the next session (not run yet). Issue 31: the family with a second calibrated
    # arm from the median of 5 timed runs (calibrated_b) beside the one-run arm; the arms now run in
    # a shuffled order each round (2026-12-05, seventh session: a fixed order measured two arms
    # with the same schedule up to 6% apart), and the table says where calibrated = search. Paging defaults:
    # the eager Pager at 8192 tokens, default slack 1.25 against 1.05 and 1.0 in one run; Qwen3-MoE
    # 1021M, the compile backend's default paging against budget 1.0 / slack 1.05, 3 rounds.
    export PYTHONUNBUFFERED=1
    # The family also has arm search_file (rule search with a costs file: 15 timed runs of ours
    # apart from the calibration), the reference issue 31 sets the calibrated order against.
    step family 200 "$py" benches/gpu_schedule_ab.py --family all --ratios 0.5,1.0,2.0 --calibrate-runs-b 5 --json "$out/family.json"
    step paging_8k_slack 200 "$py" benches/paging_ab.py --config h200 --steps 5 \
        --arms off,1s-timed:1.0,1s-timed:1.0:1.05,1s-timed:1.0:1.0 --json "$out/paging_8k_slack.json"
    ;;
s14c)
    # Prepared (not run): the seventh session's changes that touch the GPU path, none run on a GPU
    # (no device was lent): cudagraphs=True through our boxed runner (not torch's boxed_nop); the
    # Pager's hooks outside Dynamo and its keep-on-device of saves unlike calibration; compile paging
    # stepping aside inside torch.utils.checkpoint; the node path's reverse-order partial sums and
    # tied-weight buffers. The cuda tests of those files, the HF GPU matrix, the 8192-token Pager A/B.
    export PYTHONUNBUFFERED=1
    step cuda_tests 240 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_compile.py tests/python/test_paging_pager.py \
        tests/python/test_nodes_run.py tests/python/test_train_cuda.py tests/python/test_paging_nodes.py
    hf_gpu_matrix 120
    paging_8k
    ;;
s14b)
    # Prepared (not run): s14a's third part, in a call of its own (the three took more than one call's 600 s).
    export PYTHONUNBUFFERED=1
    qwen_ab hf_qwen_defaults 240 3 compiled,paging,paging_b '{}' --paging-b '{"paging_budget": 1.0, "paging_slack": 1.05}'
    ;;
s11c)
    # Issue 27: s11b's A/B without the profiled steps (3 rounds of compiled, paging, paging_gather).
    export PYTHONUNBUFFERED=1
    qwen_ab hf_qwen_rounds_s11c 300 3 compiled,paging,paging_gather '{"paging_budget": 1.0, "paging_slack": 1.1}'
    ;;
s10a|s10c)
    # Issue 27: grouped page-outs (paging_group_out: copies queued behind one wait). The paging
    # cuda tests (grouped arms included); the Qwen3-MoE A/B at budget 1.0 / slack 1.1, group 1
    # (paging) vs 4 (paging_b), compiled alongside, 2 rounds, and one profiled + traced step per
    # arm after the last round: the compute stream's idle time split (benches/trace_stalls.py).
    # Page-ins due at one point go behind one wait in both paging arms. s10a then runs the copy
    # cost bench with its controls (a wait on a done event; a kernel launched right after the
    # compute stream waits on a running copy: a release); s10c, trimmed to 690 s of device time
    # left, does not and gives the A/B less time.
    export PYTHONUNBUFFERED=1
    step paging_cuda 100 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_paging_pool.py tests/python/test_paging_pager.py \
        tests/python/test_compile.py -k "paging or pool or pager or page"
    if [ "$mode" = s10a ]; then ab_secs=280 stall_secs=60; else ab_secs=260 stall_secs=40; fi
    qwen_group4 "$ab_secs" --profile --trace "$out/traces"
    step stalls "$stall_secs" "$py" benches/trace_stalls.py "$out"/traces/*.json
    rm -rf "$out/traces"
    if [ "$mode" = s10a ]; then
        step copy_enqueue_cost 60 "$py" benches/copy_enqueue_cost.py --controls --json "$out/copy_enqueue_cost.json"
    fi
    ;;
s10d)
    # Issue 27, the least that answers it: s10a's A/B alone, no traces.
    export PYTHONUNBUFFERED=1
    qwen_group4 250
    ;;
s10b)
    # Issue 27: s10a's A/B with group 8 and one profiled, traced step per arm (benches/trace_stalls.py).
    export PYTHONUNBUFFERED=1
    qwen_ab hf_qwen_g8_trace 200 2 compiled,paging,paging_b '{"paging_budget": 1.0, "paging_slack": 1.1}' \
        --paging-b '{"paging_group_out": 8}' --profile --trace "$out/traces"
    step stalls 90 "$py" benches/trace_stalls.py "$out"/traces/*.json
    rm -rf "$out/traces"
    ;;
s9d)
    # Issue 27: does queueing a copy cost the host more the larger it is (benches/copy_enqueue_cost.py)?
    step copy_enqueue_cost 60 "$py" benches/copy_enqueue_cost.py --json "$out/copy_enqueue_cost.json"
    ;;
s9c)
    # Issue 27: the Qwen3-MoE A/B at budget 1.0 / slack 1.08 (between s6c's 1.05 and 1.1), 2 rounds.
    export PYTHONUNBUFFERED=1
    step hf_qwen_rounds_b1s1.08 200 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --rounds 2 --determinism warn \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms compiled,paging --paging '{"paging_budget": 1.0, "paging_slack": 1.08}' --out "$out/hf_qwen_rounds_b1s1.08.json"
    ;;
s9b)
    # Issue 27: where the paged forward's extra host time goes. hf_paging_ab.py now clocks the
    # Pager's save and use hooks per step. Budget 0 (every candidate goes through its page nodes
    # and stays on the device) and budget 1.0 / slack 1.1, 2 rounds each; then one cProfiled step
    # per arm at budget 1.0 / slack 1.1.
    export PYTHONUNBUFFERED=1
    step hf_qwen_rounds_keep 170 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --rounds 2 --determinism warn \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms compiled,paging --paging '{"paging_budget": 0.0}' --out "$out/hf_qwen_rounds_keep.json"
    step hf_qwen_rounds_b1s1.1 170 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --rounds 2 --determinism warn \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms compiled,paging --paging '{"paging_budget": 1.0, "paging_slack": 1.1}' --out "$out/hf_qwen_rounds_b1s1.1.json"
    step hf_qwen_py 150 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 3 --determinism warn --pyprofile \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms compiled,paging --paging '{"paging_budget": 1.0, "paging_slack": 1.1}' --out "$out/hf_qwen_py.json"
    ;;
s9a)
    # Session of 2026-12-05: the whole cuda suite (nothing ran on a GPU since s7f; the new-user
    # trial's fixes and the background calibration since), page_host_parts.py (the one-call page
    # copy against the calls from Python) and the Qwen3-MoE A/B at budget 1.0 / slack 1.1 with
    # compiled, paging and paging_pycopy alternating over 3 rounds.
    export PYTHONUNBUFFERED=1
    step cuda_suite 260 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python -k "not many_training_steps" --durations 5
    step page_host_parts 60 "$py" benches/page_host_parts.py --json "$out/page_host_parts.json"
    qwen_rounds b1s1.1 '{"paging_budget": 1.0, "paging_slack": 1.1}' compiled,paging,paging_pycopy
    ;;
s8a)
    # Issue 27: the one-call page copy (cpp/direct.cc `page_copy`): the cuda suite (its poison tests
    # now run both ways of queueing a copy), page_host_parts.py (native against the calls from
    # Python, alternating), and the Qwen3-MoE A/B at budget 1.0 / slack 1.1 with compiled, paging
    # and paging_pycopy alternating over 3 rounds.
    export PYTHONUNBUFFERED=1
    step cuda_suite 240 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python -k "not many_training_steps" \
        --ignore=tests/python/test_lifetime_cuda.py
    step page_host_parts 120 "$py" benches/page_host_parts.py --json "$out/page_host_parts.json"
    qwen_rounds b1s1.1 '{"paging_budget": 1.0, "paging_slack": 1.1}' compiled,paging,paging_pycopy
    ;;
s8c)
    # Issue 27: why the paged forward's host time doubles. compiled_dma: the unpaged compiled model
    # with 2560 MiB (what paging moves per step at budget 1.0 / slack 1.1) copied device -> pinned
    # host on a side stream from each step's start (the page-outs' traffic without paging), then
    # host -> device (the page-ins' direction). Per arm: the forward call's and backward()'s host time.
    export PYTHONUNBUFFERED=1
    step hf_qwen_dma_d2h 300 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --rounds 3 --determinism warn \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms compiled,compiled_dma,paging --paging '{"paging_budget": 1.0, "paging_slack": 1.1}' --dma-mib 2560 --dma-dir d2h \
        --out "$out/hf_qwen_dma_d2h.json"
    step hf_qwen_dma_h2d 200 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --rounds 3 --determinism warn \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms compiled,compiled_dma --dma-mib 2560 --dma-dir h2d --out "$out/hf_qwen_dma_h2d.json"
    ;;
s8b)
    # Issue 27: s8a's Qwen3-MoE A/B at the default paging options.
    export PYTHONUNBUFFERED=1
    qwen_rounds default '{}' compiled,paging,paging_pycopy
    ;;
s7e)
    # After the users'-models fixes (autograd's gradient accumulation in GraphStep and the node
    # path, static paging's candidates and run-time keep): the whole cuda suite.
    export PYTHONUNBUFFERED=1
    step cuda_suite 330 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python -k "not many_training_steps" --durations 5
    ;;
s7d)
    # Issue 27: Python's garbage collector in the paged step: its collections per step (auto) and
    # the A/B with it off during the steps (manual, as torchtitan's gc_freq), budget 1.0 / slack 1.1.
    export PYTHONUNBUFFERED=1
    for g in auto manual; do
        step hf_qwen_gc_$g 150 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --rounds 2 --gc $g --determinism warn \
            --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
            --arms compiled,paging --paging '{"paging_budget": 1.0, "paging_slack": 1.1}' --out "$out/hf_qwen_gc_$g.json"
    done
    ;;
s7c)
    # Issue 27: the host's own speed with and without the copy engines busy (host_under_dma.py),
    # then the Qwen3-MoE paging A/B with the arms alternating over 3 rounds (the host moved 1.8x
    # between seconds in s7b's call), at the defaults, budget 1.0 / slack 1.1, and that with 4 MiB min_bytes.
    export PYTHONUNBUFFERED=1
    step host_under_dma 60 "$py" benches/host_under_dma.py --json "$out/host_under_dma.json"
    qwen_rounds default '{}'
    qwen_rounds b1s1.1 '{"paging_budget": 1.0, "paging_slack": 1.1}'
    qwen_rounds b1s1.1m4 '{"paging_budget": 1.0, "paging_slack": 1.1, "paging_min_bytes": 4194304}'
    ;;
one)
    step cuda_tests 240 "$py" -m pytest -q -m cuda tests/python
    step paging_ab 150 "$py" benches/paging_ab.py --config h200 --steps 5 --json "$out/paging.json" \
        --arms off,pager:0.1:64:16,pager:0.3:128:16,save_on_cpu
    step python_overhead 60 "$py" benches/python_overhead.py --iters 2000 --json "$out/overhead.json"
    ;;
one2)
    step paging_nodes_ab 200 "$py" benches/paging_nodes_ab.py --config h200 --microbatches 4 --json "$out/paging_nodes.json"
    step paging_long 200 "$py" benches/paging_ab.py --config h200 --set seq=65536,batch=1 --steps 3 \
        --arms off,timed:1.0,timed:1.0:1.0 --json "$out/paging_long.json"
    step compile_paging_ab 150 "$py" benches/compile_paging_ab.py --config h200 --steps 3 \
        --arms eager,compiled,timed:1.0,paging:1.0 --json "$out/compile_paging.json"
    step schedule_family 100 "$py" benches/gpu_schedule_ab.py --family all --ratios 0.5,1.0,2.0 --json "$out/family.json"
    ;;
two)
    step main_job 420 bash benches/main_job_2gpu.sh "$out/mj" --arms sequential,b_then_f,ours,ours+ends,ours+ep2,ours+classic,ours+record --quiet
    step graph_step 200 env NCCL_MIN_NCHANNELS=2 NCCL_MAX_NCHANNELS=2 \
        torchrun --standalone --nproc-per-node 2 benches/compile_ab.py --config h200 --graph-step 4 --steps 4
    ;;
two2)
    step pipeline_ab 240 torchrun --standalone --nproc-per-node 2 benches/pipeline_ab.py --config pp_h200 --out "$out"
    step main_job_search 200 bash benches/main_job_2gpu.sh "$out/mj_search" --arms ours,ours+search \
        --costs benches/data/h200_main_job_durations.json --quiet
    ;;
cuda2)
    step cuda_tests 420 "$py" -m pytest -q -m cuda tests/python -rs --durations 15
    step python_overhead 90 "$py" benches/python_overhead.py --iters 2000 --json "$out/overhead.json"
    ;;
explain)
    step compile_paging_ab 200 "$py" benches/compile_paging_ab.py --config h200 --steps 3 \
        --arms eager,compiled,timed:1.0,timed:1.0:1.0 --json "$out/compile_paging.json"
    step paging_ab 200 "$py" benches/paging_ab.py --config h200 --steps 3 \
        --arms off,timed:1.0,timed:1.0:1.0 --json "$out/paging.json"
    ;;
capture)
    step capture_tests 200 "$py" -m pytest -q -m cuda -s tests/python/test_train_cuda.py
    step graph_pool 120 "$py" benches/graph_pool_probe.py --microbatches 3 --json "$out/graph_pool.json"
    step compile_min_cut 170 "$py" benches/compile_paging_ab.py --config h200 --steps 3 --partition min_cut \
        --arms eager,aot_eager,compiled,timed:1.0 --json "$out/compile_min_cut.json"
    step python_overhead 70 "$py" benches/python_overhead.py --iters 2000 --json "$out/overhead.json"
    ;;
twopage)
    for b in 0.12 0.2 0.3; do
        step "main_job_page_$b" 300 bash benches/main_job_2gpu.sh "$out/mj_page_$b" --arms ours,ours+page \
            --nccl-channels 4 --steps 3 --page-budget "$b" --page-prefetch 6 --quiet
    done
    ;;
page2)
    # Two page streams (issue 32): the cuda paging tests (SlotOrder's poison test and its control,
    # the packed page_in_group poison test), then the eager pager at 8192 tokens, one stream vs
    # two, in one run with off and save_on_cpu. About 5 minutes.
    step page2_tests 200 "$py" -m pytest -q -rs -m cuda tests/python/test_paging_pool.py tests/python/test_paging_pager.py \
        tests/python/test_paging_slot_order.py tests/python/test_paging_plan.py tests/python/test_paging_groups.py
    step paging_8k 170 "$py" benches/paging_ab.py --config h200 --steps 5 --arms off,1s-timed:1.0,timed:1.0,save_on_cpu \
        --json "$out/paging_8k.json"
    ;;
page3)
    # Two page streams at 65536 tokens and on page nodes; the compile path. About 8 minutes.
    step paging_64k 220 "$py" benches/paging_ab.py --config h200 --set seq=65536,batch=1 --steps 3 \
        --arms off,1s-timed:1.0,timed:1.0,save_on_cpu --json "$out/paging_64k.json"
    step paging_nodes 200 "$py" benches/paging_nodes_ab.py --config h200 --microbatches 4 \
        --arms off,1s-page:0.3:6:8,page:0.3:6:8 --json "$out/paging_nodes.json"
    step compile_paging 120 "$py" benches/compile_paging_ab.py --config h200 --steps 3 \
        --arms eager,compiled,1s-timed:1.0,timed:1.0 --json "$out/compile_paging.json"
    ;;
link)
    # Everything here is EMULATED EP: one process, the (K-1)/K share of each all-to-all through
    # pinned host memory on the copy engines (ep_link.py). About 6 minutes; at most 8.
    export PYTHONUNBUFFERED=1
    step link_cuda_tests 90 "$py" -m pytest -q -m cuda tests/python/test_ep_link.py -rs
    step link_rate 60 "$py" benches/link_rate.py --k 8 --j 1,4,16,64 --reps 10
    # The page arm's copies share PCIe with the link's: budget 0.2, prefetch 6 (twopage's middle).
    step main_job_link 210 "$py" -m sched_lifetime train --ep-link host:8 --config h200 --steps 2 --microbatches 8 \
        --arms sequential,b_then_f,ours,ours+ends,ours+record,ours+graph,ours+page \
        --page-budget 0.2 --page-prefetch 6 --quiet --out /tmp/main_job_link
    cp /tmp/main_job_link/train.json "$out/train_link.json" 2>/dev/null
    cp /tmp/main_job_link/durations.json "$out/durations_link.json" 2>/dev/null
    ;;
link2)
    # Issue 28's analysis pass, EMULATED EP=8 on one H200, under 10 minutes: the cuda suite (not
    # the 1000-step leak test), the link's rate, the main job's arms with exposed comm the median of
    # 5 profiled steps and every node timed alone (durations.json: the simulator's costs), then
    # the compile backend and GraphStep on the link.
    export PYTHONUNBUFFERED=1
    step cuda_suite 180 "$py" -m pytest -q -m cuda tests/python -rs -k "not many_training_steps"
    step link_rate 50 "$py" benches/link_rate.py --k 8 --j 1,16,64 --reps 5
    step main_job_link 200 "$py" -m sched_lifetime train --ep-link host:8 --config h200 --steps 2 --microbatches 8 \
        --arms sequential,ours,ours+ends --profile-steps 5 --quiet --out /tmp/main_job_link --no-traces
    for f in train.json durations.json; do cp "/tmp/main_job_link/$f" "$out/link_$f" 2>/dev/null; done
    step graph_step_link 150 "$py" benches/compile_ab.py --config h200 --ep-link host:8 --graph-step 4 --steps 4 --out "$out"
    ;;
calib)
    # Issue 31, about 8 minutes: the GPU test (one sync more in the calibrated step, none after,
    # bit-exact against ours), the family's 27 shapes with the calibrated arm beside ours,
    # ours:search (the graphs' costs) and the bound, then the main job on the emulated link
    # (EP=8) with the timing-free and the calibrated order side by side.
    export PYTHONUNBUFFERED=1
    step calib_cuda_test 120 "$py" -m pytest -q -m cuda -rs tests/python/test_train_cuda.py -k calibrated
    step schedule_family_calib 200 "$py" benches/gpu_schedule_ab.py --family all --ratios 0.5,1.0,2.0 --json "$out/family.json"
    step main_job_link_calib 240 "$py" -m sched_lifetime train --ep-link host:8 --config h200 --steps 3 --microbatches 8 \
        --arms sequential,ours,calibrated --quiet --out /tmp/main_job_calib
    cp /tmp/main_job_calib/train.json "$out/train_link_calib.json" 2>/dev/null
    ;;
calibl)
    # Issues 31 + 28 + 35 in one call on one H200 (about 7 minutes): the calibrated order's cuda
    # test, the family's 27 shapes with the calibrated arm, then the main job on the EMULATED
    # link (EP=8): exposed comm the median of 5 profiled steps, node times for the simulator.
    export PYTHONUNBUFFERED=1
    step calib_cuda_test 60 "$py" -m pytest -q -m cuda -rs tests/python/test_train_cuda.py -k calibrated
    step schedule_family_calib 150 "$py" benches/gpu_schedule_ab.py --family all --ratios 0.5,1.0,2.0 --json "$out/family.json"
    step main_job_link 200 "$py" -m sched_lifetime train --ep-link host:8 --config h200 --steps 2 --microbatches 8 \
        --arms sequential,ours,calibrated,ours+ends --profile-steps 5 --quiet --out /tmp/mjl --no-traces
    for f in train.json durations.json calibrated_calibrated.json calibrated_calibrated.txt; do cp "/tmp/mjl/$f" "$out/link_$f" 2>/dev/null; done
    ;;
calib2)
    step main_job_calib 420 bash benches/main_job_2gpu.sh "$out/mj_calib" --arms sequential,ours,calibrated --steps 3 --quiet
    ;;
four)
    step pipeline_ep2 500 torchrun --standalone --nproc-per-node 4 benches/pipeline_ab.py --config pp_h200 --ep 2 --out "$out"
    ;;
final)
    # One H200 call, under 10 minutes: issue 31 (calibrated order: its cuda test, the family's
    # shapes), issues 28/35 (main job on the EMULATED link, exposed comm the median of 5
    # profiled steps, node times), issue 27 (a third-party model's paging A/B).
    export PYTHONUNBUFFERED=1
    step calib_cuda_test 45 "$py" -m pytest -q -m cuda -rs tests/python/test_train_cuda.py -k calibrated
    step schedule_family_calib 120 "$py" benches/gpu_schedule_ab.py --family all --ratios 0.5,1.0,2.0 --json "$out/family.json"
    step main_job_link 170 "$py" -m sched_lifetime train --ep-link host:8 --config h200 --steps 2 --microbatches 8 \
        --arms sequential,ours,calibrated --profile-steps 5 --quiet --out /tmp/mjl --no-traces
    for f in train.json durations.json calibrated_calibrated.json calibrated_calibrated.txt; do cp "/tmp/mjl/$f" "$out/link_$f" 2>/dev/null; done
    step hf_qwen3_moe 230 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --out "$out/hf_qwen3_moe.json"
    ;;
hf)
    # transformers must import (the image holds 5.17.0; else carry it on PYTHONPATH).
    step hf_qwen3_moe 300 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 5 --out "$out/hf_qwen3_moe.json"
    step hf_deepseek_v3 240 "$py" benches/hf_paging_ab.py --model deepseek_v3 --seq 4096 --steps 5 --out "$out/hf_deepseek_v3.json"
    ;;
hfdet)
    # Issue 27's GPU parity and step time under strict determinism (the bench's default: the
    # attention's backward is otherwise not deterministic on an H200), every arm incl. the
    # captured one, one profiled step per arm; DeepSeek-V3 at 4096; Qwen3 with two page streams.
    step hf_qwen3_moe 220 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 5 --profile \
        --arms eager,eager_again,save_on_cpu,aot_eager,compiled,cudagraphs,paging --out "$out/hf_qwen3_moe.json"
    step hf_deepseek_v3 200 "$py" benches/hf_paging_ab.py --model deepseek_v3 --seq 4096 --steps 4 --profile \
        --arms eager,eager_again,aot_eager,compiled,cudagraphs,paging --out "$out/hf_deepseek_v3.json"
    step hf_qwen3_moe_two_way 130 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --profile \
        --arms compiled,paging --paging '{"paging_two_way": true}' --out "$out/hf_qwen3_moe_two_way.json"
    ;;
hftrace)
    # Issue 27: where paging's time goes on HF models with torch's fast (non-deterministic)
    # attention: a Chrome trace of one profiled step per arm, split by benches/trace_stalls.py.
    step hf_ds_warn 150 "$py" benches/hf_paging_ab.py --model deepseek_v3 --seq 4096 --steps 5 --determinism warn --profile \
        --trace "$out/traces" --arms eager,aot_eager,compiled,paging --out "$out/hf_ds_warn.json"
    step hf_ds_warn_two_way 110 "$py" benches/hf_paging_ab.py --model deepseek_v3 --seq 4096 --steps 4 --determinism warn --profile \
        --trace "$out/traces_two_way" --arms compiled,paging --paging '{"paging_two_way": true}' --out "$out/hf_ds_warn_two_way.json"
    step hf_qwen_warn 130 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 5 --determinism warn --profile \
        --trace "$out/traces" --arms compiled,paging --out "$out/hf_qwen_warn.json"
    step stalls 60 "$py" benches/trace_stalls.py "$out"/traces/*.json "$out"/traces_two_way/*.json
    gzip "$out"/traces/*.json "$out"/traces_two_way/*.json
    ;;
hftrace2)
    # Issue 27: the host side of paging on Qwen3-MoE (fast attention): one traced step per arm.
    step hf_qwen_warn 150 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn --profile \
        --trace "$out/traces" --arms compiled,paging --out "$out/hf_qwen_warn.json"
    step stalls 60 "$py" benches/trace_stalls.py "$out"/traces/*.json
    gzip "$out"/traces/*.json
    ;;
hfmin)
    # Issue 27: paging's host cost per paged tensor: the default paging_min_bytes (64 KiB) vs 1 MiB.
    step hf_qwen_min64k 130 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 5 --determinism warn \
        --arms compiled,paging --out "$out/hf_qwen_min64k.json"
    step hf_qwen_min1m 130 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 5 --determinism warn \
        --arms compiled,paging --paging '{"paging_min_bytes": 1048576}' --out "$out/hf_qwen_min1m.json"
    step hf_ds_min1m 130 "$py" benches/hf_paging_ab.py --model deepseek_v3 --seq 4096 --steps 5 --determinism warn \
        --arms compiled,paging --paging '{"paging_min_bytes": 1048576}' --out "$out/hf_ds_min1m.json"
    ;;
hfpy)
    # Issue 27: where paging's host time goes, by Python function (cProfile, one step per arm).
    step hf_qwen_py 150 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 3 --determinism warn --pyprofile \
        --arms compiled,paging --out "$out/hf_qwen_py.json"
    ;;
gscal)
    # Issue 31: GraphStep's calibrated order on the GPU: its cuda test, then GraphStep on the
    # emulated link (EP=8), calibrated vs the timing-free order, in one table.
    step cuda_calibrate 100 "$py" -m pytest -q -m cuda -rs tests/python/test_calibrate.py -p no:logging
    step graph_step_link 200 "$py" benches/compile_ab.py --config h200 --ep-link host:8 --graph-step 4 --steps 4 --out "$out"
    ;;
s7b)
    # Issue 27: where paging's extra time goes at the defaults and at budget 1.0 / slack 1.1 (the
    # settings closest to the target) on the GPU-bound Qwen3-MoE config: one traced step per arm,
    # split by trace_stalls.py into host-late and stalled (under a copy) gaps.
    export PYTHONUNBUFFERED=1
    big=hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024
    for name in default b1s1.1; do
        json='{}'
        [ "$name" = b1s1.1 ] && json='{"paging_budget": 1.0, "paging_slack": 1.1}'
        step hf_qwen_big_${name}_trace 130 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
            --set "$big" --arms compiled,paging --paging "$json" --profile --trace "$out/traces_$name" --out "$out/hf_qwen_big_$name.json"
        step stalls_$name 60 "$py" benches/trace_stalls.py "$out"/traces_$name/*.json
        gzip "$out"/traces_$name/*.json
    done
    ;;
s7a)
    # After the compile paging's in-place check (a version-counter capsule per page-out) and the
    # 0-byte rule moved into Rust: the whole cuda suite (not run whole since ae1737e), a paged
    # value's host time by primitive, the GPU-bound Qwen3-MoE config at the defaults and at
    # budget 1.0 / slack 1.1.
    export PYTHONUNBUFFERED=1
    step cuda_suite 330 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python -k "not many_training_steps" --durations 8
    step page_host_parts 50 "$py" benches/page_host_parts.py --json "$out/page_host_parts.json"
    qwen_big default '{}'
    qwen_big b1s1.1 '{"paging_budget": 1.0, "paging_slack": 1.1}'
    ;;
s6d)
    # Issues 27 and 31 after s6c's changes (a page-out's manager bound and retired in one call):
    # the paging, calibration and compile cuda tests, GraphStep's calibration cost again (s6c's
    # host was noisy), the GPU-bound Qwen3-MoE config at the defaults and at budget 1.0 / slack 1.1.
    export PYTHONUNBUFFERED=1
    step cuda_tests 170 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_paging_plan.py tests/python/test_paging_pager.py \
        tests/python/test_paging_pool.py tests/python/test_paging_slot_order.py tests/python/test_paging_groups.py tests/python/test_calibrate.py \
        tests/python/test_compile.py tests/python/test_lifetime_cuda.py
    step page_host_parts 80 "$py" benches/page_host_parts.py --json "$out/page_host_parts.json"
    step calibration_cost_graph_step 140 "$py" benches/calibration_cost.py --config h200 --ep-link host:8 --microbatches 8 --steps 7 \
        --paths graph_step --json "$out/calibration_cost_graph_step.json"
    qwen_big default '{}'
    qwen_big b1s1.1 '{"paging_budget": 1.0, "paging_slack": 1.1}'
    ;;
s6c)
    # Issue 27: the page copies' raw event calls against torch.cuda's wrappers in one process
    # (page_host_us alternating), and the GPU-bound Qwen3-MoE config at budget 1.0 / slack 1.1
    # twice more, slack 1.05, and slack 1.1 with 4 MiB min_bytes. Issue 31: GraphStep's
    # calibration step timing one run of the module instead of every run.
    export PYTHONUNBUFFERED=1
    step page_host_parts 80 "$py" benches/page_host_parts.py --json "$out/page_host_parts.json"
    step calibration_cost_graph_step 140 "$py" benches/calibration_cost.py --config h200 --ep-link host:8 --microbatches 8 --steps 7 \
        --paths graph_step --json "$out/calibration_cost_graph_step.json"
    qwen_big b1s1.1 '{"paging_budget": 1.0, "paging_slack": 1.1}'
    qwen_big b1s1.1r '{"paging_budget": 1.0, "paging_slack": 1.1}'
    qwen_big b1s1.05 '{"paging_budget": 1.0, "paging_slack": 1.05}'
    qwen_big b1s1.1m4 '{"paging_budget": 1.0, "paging_slack": 1.1, "paging_min_bytes": 4194304}'
    ;;
s6b)
    # Issue 27: a page copy's event calls without torch.cuda's Python wrappers: the paging cuda
    # tests, a page-out and its page-in's host time by primitive with this tree and with the
    # previous commit's paging (.ab_old/torch_ops, when present), the GPU-bound Qwen3-MoE config
    # at the defaults and at budget 1.0 / slack 1.15 and 1.1. Issue 31: GraphStep's calibration
    # step with its timed module built in advance.
    export PYTHONUNBUFFERED=1
    step paging_cuda_tests 120 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_paging_plan.py tests/python/test_paging_pager.py \
        tests/python/test_paging_pool.py tests/python/test_paging_slot_order.py tests/python/test_paging_groups.py tests/python/test_calibrate.py
    step page_host_parts 50 "$py" benches/page_host_parts.py --json "$out/page_host_parts.json"
    if [ -d "$here/.ab_old/torch_ops" ]; then
        PYTHONPATH="$here/.ab_old/torch_ops" step page_host_parts_old 50 "$py" benches/page_host_parts.py --json "$out/page_host_parts_old.json"
    fi
    step calibration_cost_graph_step 140 "$py" benches/calibration_cost.py --config h200 --ep-link host:8 --microbatches 8 --steps 7 \
        --paths graph_step --json "$out/calibration_cost_graph_step.json"
    qwen_big default '{}'
    qwen_big b1s1.15 '{"paging_budget": 1.0, "paging_slack": 1.15}'
    qwen_big b1s1.1 '{"paging_budget": 1.0, "paging_slack": 1.1}'
    ;;
s6a)
    # Issue 27: where a paged tensor's host time goes (each CUDA primitive of a page-out and its
    # page-in, one page stream and two), and two page streams on the GPU-bound Qwen3-MoE config
    # at budget 1.0 / slack 1.15 and 1.2 beside one stream at 1.15. Issue 31: GraphStep's
    # calibration step with the tick nodes (instead of torch.fx.Interpreter) and its cuda test.
    export PYTHONUNBUFFERED=1
    step page_host_parts 60 "$py" benches/page_host_parts.py --json "$out/page_host_parts.json"
    step page_host_parts_two_way 60 "$py" benches/page_host_parts.py --two-way --json "$out/page_host_parts_two_way.json"
    big=hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024
    for arm in '1.15 false' '1.15 true' '1.2 true'; do
        set -- $arm
        step hf_qwen_big_b1s$1_tw$2 75 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
            --set "$big" --arms compiled,paging --paging "{\"paging_budget\": 1.0, \"paging_slack\": $1, \"paging_two_way\": $2}" \
            --out "$out/hf_qwen_big_b1s$1_tw$2.json"
    done
    step calibration_cost_graph_step 140 "$py" benches/calibration_cost.py --config h200 --ep-link host:8 --microbatches 8 --steps 7 \
        --paths graph_step --json "$out/calibration_cost_graph_step.json"
    step cuda_calibrate 80 "$py" -m pytest -q -m cuda -rs -p no:logging tests/python/test_calibrate.py
    ;;
s5a)
    # Issue 27: the GPU-bound Qwen3-MoE config (fast attention), paging budget 1.0 at the default
    # slack and at slack 1.0, each against compiled in its own run. Issue 32: page nodes, one page
    # stream vs two, at budgets 0.3 and 0.4, in one run with off.
    export PYTHONUNBUFFERED=1
    big=hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024
    step hf_qwen_big_b1 110 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
        --set "$big" --arms compiled,paging --paging '{"paging_budget": 1.0}' --out "$out/hf_qwen_big_b1.json"
    step hf_qwen_big_b1s1 110 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
        --set "$big" --arms compiled,paging --paging '{"paging_budget": 1.0, "paging_slack": 1.0}' --out "$out/hf_qwen_big_b1s1.json"
    step paging_nodes 240 "$py" benches/paging_nodes_ab.py --config h200 --microbatches 4 \
        --arms off,1s-page:0.3:6:8,page:0.3:6:8,1s-page:0.4:6:8,page:0.4:6:8 --json "$out/paging_nodes.json"
    ;;
s5b)
    # Issue 27: where paging's extra time goes at budget 1.0 / slack 1.0 on the GPU-bound Qwen3-MoE
    # config (one traced step per arm, split by trace_stalls.py), and slack 1.1 / 1.15 between
    # s5a's 1.0 and the default 1.25.
    export PYTHONUNBUFFERED=1
    big=hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024
    step hf_qwen_big_b1s1_trace 130 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
        --set "$big" --arms compiled,paging --paging '{"paging_budget": 1.0, "paging_slack": 1.0}' --profile --trace "$out/traces" \
        --out "$out/hf_qwen_big_b1s1.json"
    step stalls 60 "$py" benches/trace_stalls.py "$out"/traces/*.json
    gzip "$out"/traces/*.json
    for sl in 1.1 1.15; do
        step hf_qwen_big_b1s$sl 110 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
            --set "$big" --arms compiled,paging --paging "{\"paging_budget\": 1.0, \"paging_slack\": $sl}" --out "$out/hf_qwen_big_b1s$sl.json"
    done
    ;;
s5c)
    # Issue 27: fewer host calls per step: paging only saved values of at least 4 MiB, budget 1.0,
    # slack 1.0 and 1.1 (s5a/s5b: 64 KiB, the default).
    export PYTHONUNBUFFERED=1
    big=hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024
    for sl in 1.0 1.1; do
        step hf_qwen_big_b1s${sl}_4m 110 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
            --set "$big" --arms compiled,paging --paging "{\"paging_budget\": 1.0, \"paging_slack\": $sl, \"paging_min_bytes\": 4194304}" \
            --out "$out/hf_qwen_big_b1s${sl}_4m.json"
    done
    ;;
s5d)
    # Issue 27: the timed plan counts host time (page_host_us: a value whose copy is shorter than
    # a page-out's host calls stays). The paging cuda tests, then the GPU-bound Qwen3-MoE config
    # at the defaults, budget 1.0 / slack 1.1 and 1.0; the default (host-bound) config with and
    # without count_host; the eager Pager at 8192 tokens (config h200).
    export PYTHONUNBUFFERED=1
    step paging_cuda_tests 150 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_paging_plan.py tests/python/test_paging_pager.py \
        tests/python/test_paging_pool.py tests/python/test_paging_slot_order.py tests/python/test_paging_groups.py
    big=hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024
    step hf_qwen_big_default 100 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
        --set "$big" --arms compiled,paging --out "$out/hf_qwen_big_default.json"
    for sl in 1.1 1.0; do
        step hf_qwen_big_b1s$sl 100 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
            --set "$big" --arms compiled,paging --paging "{\"paging_budget\": 1.0, \"paging_slack\": $sl}" --out "$out/hf_qwen_big_b1s$sl.json"
    done
    step hf_qwen_small 90 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
        --arms compiled,paging --out "$out/hf_qwen_small.json"
    step hf_qwen_small_nohost 90 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
        --arms compiled,paging --paging '{"paging_count_host": false}' --out "$out/hf_qwen_small_nohost.json"
    ;;
s5e)
    # Issue 31: what calibration costs a step, foreground and background search, on the node API
    # and on GraphStep (EMULATED EP=8 link); the paging and calibration cuda tests after this
    # session's changes (the host-time rule, GraphStep's background search).
    export PYTHONUNBUFFERED=1
    step calibration_cost 300 "$py" benches/calibration_cost.py --config h200 --ep-link host:8 --microbatches 8 --steps 6 \
        --json "$out/calibration_cost.json"
    step cuda_tests 200 "$py" -m pytest -q -rs -m cuda -p no:logging tests/python/test_paging_plan.py tests/python/test_paging_pager.py \
        tests/python/test_paging_pool.py tests/python/test_calibrate.py tests/python/test_compile.py
    ;;
s4h)
    # Issue 27: the GPU-bound Qwen3-MoE config (fast attention) with paging's budget at 1.0 and the
    # timed plan's slack at 1.0 (defaults 0.5 and 1.25), against paging off.
    export PYTHONUNBUFFERED=1
    step hf_qwen_big_b1s1 100 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms compiled,paging --paging '{"paging_budget": 1.0, "paging_slack": 1.0}' --out "$out/hf_qwen_big_b1s1.json"
    ;;
s4g)
    # Issues 28/31: the family's 27 shapes with the stand-in transfers waiting for the compute
    # issued before them (as the real transports do), ours vs launch_first vs search vs calibrated.
    export PYTHONUNBUFFERED=1
    step schedule_family_wait 200 "$py" benches/gpu_schedule_ab.py --family all --ratios 0.5,1.0,2.0 --json "$out/family.json"
    ;;
s4f)
    # Issue 28: rule launch_first (arm ours+first) on the EMULATED link (EP=8) beside ours,
    # calibrated (search seeded with it) and the paired ends, in one run.
    export PYTHONUNBUFFERED=1
    step main_job_link 300 "$py" -m sched_lifetime train --ep-link host:8 --config h200 --steps 2 --microbatches 8 \
        --arms sequential,ours,ours+first,calibrated,ours+ends --profile-steps 5 --quiet --out /tmp/mjl --no-traces
    for f in train.json calibrated_calibrated.txt; do cp "/tmp/mjl/$f" "$out/link_$f" 2>/dev/null; done
    ;;
s4e)
    # Issue 31: GraphStep's calibrated order on the GPU (its cuda test, then GraphStep on the
    # EMULATED link, EP=8: sequential, calibrated, ours, paired ends), with rule search's
    # launch-wait model.
    export PYTHONUNBUFFERED=1
    step cuda_calibrate 80 "$py" -m pytest -q -m cuda -rs tests/python/test_calibrate.py -p no:logging
    step graph_step_link 360 "$py" benches/compile_ab.py --config h200 --ep-link host:8 --graph-step 4 --steps 3 --out "$out"
    ;;
s4d)
    # Issues 28 and 31 (about 6 minutes): the main job on the EMULATED link (EP=8) after rule
    # search's model learned the launch waits (an EP launch waits for the compute issued before
    # it) and the calibration timed comm nodes without that wait: sequential, ours, calibrated,
    # ours+ends, exposed comm the median of 5 profiled steps; then the family's 27 shapes.
    export PYTHONUNBUFFERED=1
    step main_job_link 230 "$py" -m sched_lifetime train --ep-link host:8 --config h200 --steps 2 --microbatches 8 \
        --arms sequential,ours,calibrated,ours+ends --profile-steps 5 --quiet --out /tmp/mjl --no-traces
    for f in train.json durations.json calibrated_calibrated.txt; do cp "/tmp/mjl/$f" "$out/link_$f" 2>/dev/null; done
    step schedule_family_calib 130 "$py" benches/gpu_schedule_ab.py --family all --ratios 0.5,1.0,2.0 --json "$out/family.json"
    ;;
s4c)
    # Issue 27: step times with torch's fast attention (--determinism warn: strict makes
    # AOTAutograd's graphs of Qwen3-MoE ~10x slower, so strict-mode times are not the model's),
    # the GPU-bound config and 16384 tokens; then which kernel strict slows (default config,
    # eager vs aot_eager, profiled).
    export PYTHONUNBUFFERED=1
    step hf_qwen_big_warn 170 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 --determinism warn --profile \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms eager,save_on_cpu,aot_eager,compiled,paging --out "$out/hf_qwen_big_warn.json"
    step hf_qwen_16k_warn 150 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 16384 --steps 4 --determinism warn --profile \
        --arms aot_eager,compiled,paging --out "$out/hf_qwen_16k_warn.json"
    step hf_strict_kernels 120 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 2 --profile \
        --arms eager,aot_eager --out "$out/hf_strict_kernels.json"
    ;;
s4b)
    # Issue 27 again: the GPU-bound config (num_experts spelled as the image's transformers
    # takes it), and 16384 tokens with aot_eager for parity.
    export PYTHONUNBUFFERED=1
    step hf_qwen_big 230 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms eager,save_on_cpu,aot_eager,compiled,paging --out "$out/hf_qwen_big.json"
    step hf_qwen_16k 200 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 16384 --steps 4 \
        --arms aot_eager,compiled,paging --out "$out/hf_qwen_16k.json"
    ;;
s4)
    # Issues 27 and 32 on one H200 (about 9 minutes). Issue 27: paging on a GPU-bound Hugging Face
    # config (Qwen3-MoE, hidden 2048, 16 experts of 1024, about 1B parameters) at 8192 tokens
    # against off, save_on_cpu and aot_eager, and the default config at 16384 tokens. Issue 32:
    # 65536 tokens, the timed Pager (slack 1) on one page stream vs two.
    export PYTHONUNBUFFERED=1
    step hf_qwen_big 220 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 8192 --steps 4 \
        --set hidden_size=2048,num_attention_heads=32,num_key_value_heads=8,num_experts=16,moe_intermediate_size=1024 \
        --arms eager,save_on_cpu,aot_eager,compiled,paging --out "$out/hf_qwen_big.json"
    step hf_qwen_16k 120 "$py" benches/hf_paging_ab.py --model qwen3_moe --seq 16384 --steps 4 \
        --arms compiled,paging --out "$out/hf_qwen_16k.json"
    step paging_long_two_way 190 "$py" benches/paging_ab.py --config h200 --set seq=65536,batch=1 --steps 3 \
        --arms off,1s-timed:1.0:1.0,timed:1.0:1.0 --json "$out/paging_long_two_way.json"
    ;;
*)
    echo "unknown mode $mode: one, one2, two, two2, cuda2, explain, capture, four, twopage, link, link2, page2, page3, calib, calibl, calib2, hf, hfdet, hftrace, hftrace2, hfmin, hfpy, gscal, s4 or final" >&2
    exit 2
    ;;
esac
for f in "$out"/*.log; do
    echo "== $(basename "$f")"
    grep -v "^W1\|Warning\|warn(" "$f" | tail -12
done

"""training.profiling: the reduction of a profiled step's trace to its parts (exact arithmetic)."""

import pytest

from training.profiling import LARGEST, NAME_CHARS, OPTIMIZER_RANGE, breakdown, classify


def k(name, ts, dur, stream=7):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream, "ph": "X"}


@pytest.mark.parametrize(
    "name,cat",
    [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "gemm"),
        ("aten::mm", "gemm"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
        ("triton_red_fused_rms_norm_0", "other"),
    ],
)
def test_classify(name, cat):
    assert classify(name) == cat


def test_optimizer_window_claims_compute_but_not_collectives():
    assert classify("multi_tensor_apply_kernel<AdamFunctor>", in_optimizer=True) == "optimizer"
    assert classify("sm90_xmma_gemm", in_optimizer=True) == "optimizer"
    assert classify("ncclDevKernel_AllGather_RING_LL", in_optimizer=True) == "communication"


def test_gpu_breakdown_arithmetic():
    # a 1000 us step: gemm 0-300, attention 300-400, an all-reduce 350-600 on another stream
    # (50 us under attention, 200 us exposed), elementwise 650-700, Adam 800-900 in the optimizer
    events = [
        k("sm90_xmma_gemm_bf16", 0, 300),
        k("flash_fwd_kernel", 300, 100),
        k("ncclDevKernel_AllReduce_Sum_bf16", 350, 250, stream=20),
        k("vectorized_elementwise_kernel", 650, 50),
        k("multi_tensor_apply_kernel", 800, 100),
        {"cat": "gpu_user_annotation", "name": OPTIMIZER_RANGE, "ts": 790, "dur": 120},
        {"cat": "user_annotation", "name": OPTIMIZER_RANGE, "ts": 720, "dur": 200},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},  # host side: not counted on a GPU
    ]
    b = breakdown(events, step_time_s=0.001)
    assert b["source"] == "cuda kernels" and b["kernels"] == 5
    got = {c: round(v["kernel_s"] * 1e6) for c, v in b["categories"].items()}
    assert got == {"gemm": 300, "attention": 100, "communication": 250, "other": 50, "optimizer": 100}
    assert b["categories"]["gemm"]["share"] == pytest.approx(0.3)
    assert round(b["busy_s"] * 1e6) == 300 + 100 + 200 + 50 + 100  # union: the overlapped 50 us once
    assert round(b["idle_s"] * 1e6) == 1000 - 750
    assert round(b["communication_exposed_s"] * 1e6) == 200
    assert round(b["optimizer_wall_s"] * 1e6) == 200
    assert round(b["optimizer_idle_s"] * 1e6) == 200 - 100  # 720-920 on the host, Adam's 800-900 on the device
    # between kernels: 600-650 (no host event spans it) and 700-800 (inside the optimizer's range)
    gaps = [(round(g["s"] * 1e6), round(g["at_s"] * 1e6), g["host"]) for g in b["gaps"]]
    assert gaps == [(100, 700, OPTIMIZER_RANGE), (50, 600, "")]
    largest = {c: [(x["name"], round(x["kernel_s"] * 1e6), x["calls"]) for x in v] for c, v in b["largest"].items()}
    assert largest == {
        "gemm": [("sm90_xmma_gemm_bf16", 300, 1)],
        "attention": [("flash_fwd_kernel", 100, 1)],
        "communication": [("ncclDevKernel_AllReduce_Sum_bf16", 250, 1)],
        "other": [("vectorized_elementwise_kernel", 50, 1)],
        "optimizer": [("multi_tensor_apply_kernel", 100, 1)],
    }


def test_peer_copies_and_symmetric_memory_barriers_are_communication():
    """Collectives on symmetric memory run as copies between the devices (no kernel) and barrier
    kernels: both count as communication, exposed where no compute kernel runs beside them; a copy
    within one device is not counted."""
    memcpy = lambda name, ts, dur: {"cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur, "tid": 30, "ph": "X"}
    events = [
        k("nvjet_sm90_tst_256x128", 0, 400),
        memcpy("Memcpy PtoP (Device -> Device)", 100, 400),  # 100 us past the GEMM
        k("c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)", 500, 20, stream=30),
        memcpy("Memcpy DtoD (Device -> Device)", 600, 50),
        k("vectorized_elementwise_kernel<CUDAFunctor_add>", 700, 50),
    ]
    b = breakdown(events, step_time_s=0.001)
    got = {c: round(v["kernel_s"] * 1e6) for c, v in b["categories"].items()}
    assert got == {"gemm": 400, "attention": 0, "communication": 420, "other": 50, "optimizer": 0}
    assert b["kernels"] == 4 and round(b["communication_exposed_s"] * 1e6) == 120
    assert round(b["busy_s"] * 1e6) == 520 + 50


def test_largest_kernels_sum_their_calls_and_keep_the_top_ones():
    """A part's kernels of one name are summed over their calls, ordered by that sum, the first
    LARGEST kept; a long (templated) name is cut to NAME_CHARS, so its calls still meet."""
    long_name = "void at::native::elementwise_kernel<" + "x" * 400
    events = [
        k("add_kernel", 0, 10),
        k("add_kernel", 10, 10),
        k("add_kernel", 20, 10),
        k(long_name + "a", 30, 25),
        k(long_name + "b", 55, 25),
    ]
    events += [k(f"small_{i}", 100 + i, 1) for i in range(LARGEST + 2)]
    other = breakdown(events, step_time_s=0.001)["largest"]["other"]
    assert [(x["name"], round(x["kernel_s"] * 1e6), x["calls"]) for x in other[:2]] == [
        (long_name[:NAME_CHARS], 50, 2),
        ("add_kernel", 30, 3),
    ]
    assert len(other) == LARGEST and all(x["kernel_s"] == pytest.approx(1e-6) for x in other[2:])


def test_cpu_breakdown_counts_self_time_once():
    # one training thread: linear (0-100) calls mm (10-90) which calls a helper (20-30);
    # an elementwise op after it; a collective on a helper thread during 150-250
    ops = [
        {"cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 100, "tid": 1},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 80, "tid": 1},
        {"cat": "cpu_op", "name": "aten::resolve_conj", "ts": 20, "dur": 10, "tid": 1},
        {"cat": "cpu_op", "name": "aten::mul", "ts": 200, "dur": 50, "tid": 1},
        {"cat": "cpu_op", "name": "aten::add_", "ts": 260, "dur": 40, "tid": 1},
        {"cat": "user_annotation", "name": OPTIMIZER_RANGE, "ts": 255, "dur": 50, "tid": 1},
        {"cat": "user_annotation", "name": "gloo:all_reduce", "ts": 150, "dur": 100, "tid": 2},
    ]
    b = breakdown(ops, step_time_s=0.0005)
    got = {c: round(v["kernel_s"] * 1e6) for c, v in b["categories"].items()}
    # linear's own 20 us is "other"; mm and its helper are 80 us of GEMM
    assert got == {"gemm": 80, "other": 20 + 50, "optimizer": 40, "communication": 100, "attention": 0}
    assert round(b["busy_s"] * 1e6) == 100 + 100 + 40  # 0-100, 150-250 (collective, then mul), 260-300
    assert round(b["communication_exposed_s"] * 1e6) == 50  # 150-200: nothing else ran
    assert round(b["idle_s"] * 1e6) == 500 - 240
    largest = {c: [(x["name"], round(x["kernel_s"] * 1e6)) for x in v] for c, v in b["largest"].items()}
    # self time by name: mm's own 70 us and the helper it calls, counted as GEMM time
    assert largest == {
        "gemm": [("aten::mm", 70), ("aten::resolve_conj", 10)],
        "other": [("aten::mul", 50), ("aten::linear", 20)],
        "optimizer": [("aten::add_", 40)],
        "communication": [("gloo:all_reduce", 100)],
        "attention": [],
    }


def test_gaps_in_the_report():
    """The longest stretches with no kernel, as results.md shows them; none on a CPU trace."""
    from run_benchmarks.judging.results import gap_lines

    gaps = [{"s": 0.189, "at_s": 1.9796, "host": OPTIMIZER_RANGE}, {"s": 0.005, "at_s": 1.9665, "host": ""}]
    assert gap_lines(gaps) == [
        "",
        "| no kernel running (ms) | from the first kernel (s) | on the host meanwhile |",
        "|---|---|---|",
        f"| 189.0 | 1.980 | `{OPTIMIZER_RANGE}` |",
        "| 5.0 | 1.966 | no torch operator |",
    ]
    assert gap_lines([]) == []

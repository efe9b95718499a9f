"""Any device: a CUDA model matches the CPU model (float64) and trains in bfloat16. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from v4_helpers import boundary_ties, build, fresh_gen, packed_batch, tiny_args
from v4launch.model import V4Model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("phase", ["dense", "warmup", "sparse"])
def test_cuda_float64_matches_cpu(phase):
    gen = fresh_gen()
    for _ in range(20):  # redraw while a top-k boundary holds an exact tie (either selection is right)
        cpu = build(tiny_args(), phase, gen)
        batch = packed_batch([1, 5, 133, 40], cpu.args.vocab_size, gen)
        if phase == "dense" or boundary_ties(cpu, batch) == 0:  # the warm-up attends the top-k too
            break
    else:
        pytest.fail("20 draws in a row held a top-k boundary tie")
    gpu = V4Model(tiny_args(), phase).double().cuda()
    gpu.load_state_dict(cpu.state_dict(), strict=True)
    a = cpu(*batch, return_logits=True)
    b = gpu(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in batch), return_logits=True)
    assert (a.logits - b.logits.cpu()).abs().max().item() < 1e-9
    for name, val in a.aux_losses.items():
        assert abs(val.item() - b.aux_losses[name].item()) < 1e-9, name


def test_cuda_bfloat16_trains_and_builds_indexers_on_device():
    gen = fresh_gen()
    model = V4Model(tiny_args(), "dense").cuda().bfloat16()
    model.set_phase("warmup")
    idx = model.layers[1].attn.indexer
    assert idx.wq_b.weight.is_cuda and idx.wq_b.weight.dtype == torch.bfloat16
    assert idx.compressor.ape.dtype == torch.float32
    cpu = V4Model(tiny_args(), "warmup")
    assert torch.equal(cpu.layers[1].attn.indexer.wq_b.weight.bfloat16(), idx.wq_b.weight.cpu())
    batch = [t.cuda() if isinstance(t, torch.Tensor) else t for t in packed_batch([300, 90], 61, gen)]
    out = model(*batch)
    loss = out.lm_loss + sum(out.aux_losses.values())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if not n.startswith("mtp."))


def _sparse_triton_model(dtype: torch.dtype) -> V4Model:
    """The benchmark's structure at small width (SWA + hash router, CSA, HCA, MTP; 16 heads x 512) in the
    sparse phase on the Triton kernels, in ``dtype``."""
    from v4launch.model import ModelArgs

    args = ModelArgs(vocab_size=4096, dim=256, n_layers=3, n_mtp_layers=1, compress_ratios=(0, 4, 128, 0),
                     n_heads=16, head_dim=512, rope_head_dim=64, q_lora_rank=256, o_groups=4, o_lora_rank=256,
                     window_size=128, index_n_heads=16, index_head_dim=128, index_topk=64, n_routed_experts=8,
                     n_activated_experts=2, moe_inter_dim=256, n_hash_layers=1, hc_mult=4)
    model = V4Model(args, "dense").cuda()
    model.set_phase("warmup")
    model.set_phase("sparse")
    model = model.to(dtype)
    model.set_kernel_backend("triton")
    return model


def test_compiled_blocks_over_the_triton_kernels_match_eager_without_breaking_at_them():
    """compile_blocks (inductor) over the custom kernel operators, float32, sparse phase: the same loss and
    gradients as eager, and no graph break at a kernel entry point (the CPU test, compile_cases.py, runs
    aot_eager through the interpreter; this one runs inductor's code on the GPU)."""
    from torch._dynamo.utils import counters

    from v4launch.model.compile import compile_blocks
    from v4launch.model.kernels import BackendUnavailable

    model = _sparse_triton_model(torch.float32)
    tokens, cu, max_seqlen, labels = packed_batch([700, 1024, 324], model.args.vocab_size, fresh_gen())
    tokens, labels = tokens.cuda(), labels.cuda()
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads():
        out = model(tokens, cu, max_seqlen, labels)
        loss = out.lm_loss + sum(out.aux_losses.values())
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return float(loss), torch.cat([(g if g is not None else torch.zeros_like(p)).flatten()
                                       for p, g in zip(params, grads)]).double()

    try:
        loss, grads = loss_and_grads()
    except BackendUnavailable as e:
        pytest.skip(f"no Triton kernels here: {e}")
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(model)
    loss_c, grads_c = loss_and_grads()
    entry_points = ("sparse_sink_attention", "indexer_topk", "head_avg_probs", "student_scores")
    breaks = [r for r in counters["graph_break"] if any(name in r for name in entry_points)]
    assert not breaks, breaks
    assert abs(loss_c - loss) <= 1e-4 * abs(loss), (loss_c, loss)
    assert float((grads_c - grads).norm() / grads.norm()) <= 1e-3


def test_a_bf16_training_step_on_the_triton_kernels_waits_on_the_gpu_only_where_stated():
    """One training step (forward, backward, fused AdamW, router-bias update) of a bf16 model on the
    Triton kernels, sparse phase, segments on the host as the job passes them, under CUDA's sync
    debug mode and the profiler: the host waits on the GPU once, for check_ids' combined range read
    (packing.py), and not at all for a batch whose ids were checked on the host (``ids_checked``). Measured before the fix: 25 waits per benchmark step (the RoPE tables copied to the GPU
    per layer and batch, the indexer's entry range read per CSA layer, the router-bias guard per layer).
    The step runs twice first: the RoPE tables are copied to the GPU once, on first use."""
    from v4launch.model.kernels import BackendUnavailable
    from v4launch.training.step_profile import host_waits

    model = _sparse_triton_model(torch.bfloat16)
    args = model.args
    tokens, cu, max_seqlen, labels = packed_batch([700, 1024, 324], args.vocab_size, fresh_gen())
    tokens, labels = tokens.cuda(), labels.cuda()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

    checked = [False]  # True: the ids were range-checked on the host (the job's batches: data_io.to_device)

    def step():
        out = model(tokens, cu, max_seqlen, labels, ids_checked=checked[0])
        (out.lm_loss + sum(out.aux_losses.values())).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias(1e-3)

    try:
        step()
    except BackendUnavailable as e:
        pytest.skip(f"no Triton kernels here: {e}")
    step()

    def model_function(stack) -> str:  # the innermost frame in a model file
        inner = [f for f in stack if "/model/" in f.filename and "/tests/" not in f.filename]
        return f"{inner[-1].filename.rsplit('/', 1)[-1]}:{inner[-1].name}" if inner else "outside the model"

    seen = host_waits(step, model_function)
    # the count comes from the profiler (the stream synchronisations the step's threads made, the backward's
    # included); the sync-debug trace above names the model function behind each, for the message
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    waits = sum(e.count for e in prof.key_averages() if e.key == "cudaStreamSynchronize")
    assert waits == 1, f"{waits} host waits in one step; where (sync debug mode): {dict(seen)}"
    assert seen.get("packing.py:check_ids") == 1, dict(seen)
    checked[0] = True  # the job's step: no wait at all, so the host can queue it while the GPU runs the last one
    seen = host_waits(step, model_function)
    assert not seen, dict(seen)


def test_routed_experts_fp8_grouped_gemm_tracks_float64_and_never_waits_on_the_host():
    """The routed experts under an FP8 recipe (``run_local_experts(fp8=True)``: model/fp8_experts.py, rowwise
    e4m3 ``torch._scaled_grouped_mm`` on SM90, groups of any row count): outputs and gradients within FP8's error of
    per-expert float64 matmuls, further from them than the bf16 grouped GEMM (so FP8 ran), an expert with no rows
    gets exactly zero weight gradients, and neither pass reads anything on the host (CUDA sync debug mode: the
    graph capture and the host's queueing ahead need that)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs SM90+")
    from v4launch.model.moe import Expert, run_local_experts

    gen = fresh_gen()
    dim, inter, n_experts = 512, 256, 4
    experts = [Expert(dim, inter, swiglu_limit=0.0) for _ in range(n_experts)]
    for e in experts:
        for lin in (e.w1, e.w2, e.w3):
            lin.weight.data = (torch.randn(lin.weight.shape, generator=gen) / lin.in_features ** 0.5).cuda().bfloat16()
    counts = torch.randint(1, 300, (n_experts,), generator=gen)
    counts[1] = 0
    x0 = torch.randn(int(counts.sum()), dim, generator=gen).bfloat16()
    dy = torch.randn(int(counts.sum()), dim, generator=gen).cuda().bfloat16()
    start, ref_y, ref_dx, ref_dw = 0, [], [], []
    for expert, n in zip(experts, counts.tolist()):  # the float64 reference, expert by expert
        w = [getattr(expert, k).weight.detach().cpu().double().requires_grad_() for k in ("w1", "w3", "w2")]
        xr = x0[start:start + n].double().requires_grad_()
        gate, up = xr @ w[0].T, xr @ w[1].T
        y = (gate * torch.sigmoid(gate) * up) @ w[2].T
        (y * dy[start:start + n].cpu().double()).sum().backward()
        ref_y.append(y.detach())
        ref_dx.append(xr.grad)
        ref_dw.append([wi.grad for wi in w])
        start += n
    ref_y, ref_dx = torch.cat(ref_y), torch.cat(ref_dx)

    def rel(a, b):
        return float((a.cpu().double() - b).norm() / b.norm())

    errors = {}
    for fp8 in (False, True):
        x, counts_dev = x0.cuda().requires_grad_(), counts.cuda()  # copies from the host: before the check
        # a first pass compiles the regions (SwiGLU): inductor's compilation reads the device, the step does not
        (run_local_experts(experts, x, counts_dev, grouped=True, fp8=fp8).float() * dy.float()).sum().backward()
        for e in experts:
            e.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host read of counts raises
        try:
            y = run_local_experts(experts, x, counts_dev, grouped=True, fp8=fp8)
            (y.float() * dy.float()).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        errors[fp8] = rel(y, ref_y)
        assert rel(x.grad, ref_dx) <= (0.1 if fp8 else 0.02), (fp8, rel(x.grad, ref_dx))
        for e, (expert, n) in enumerate(zip(experts, counts.tolist())):
            for k, want in zip(("w1", "w3", "w2"), ref_dw[e]):
                g = getattr(expert, k).weight.grad
                assert g is not None and bool((g == 0).all()) == (n == 0), (fp8, e, k)
                if n:
                    assert rel(g, want) <= (0.1 if fp8 else 0.02), (fp8, e, k, rel(g, want))
    assert errors[True] <= 0.08 and errors[False] <= 0.01, errors
    assert errors[True] > 2 * errors[False], errors  # e4m3 rounding: the FP8 GEMM ran

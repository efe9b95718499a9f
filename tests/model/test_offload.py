"""Activation offload (parallel/offload.py) under whole-layer recompute: the hooks pack exactly each layer's inputs,
gradients are bitwise those of recompute alone (one forward, two interleaved micro-batches, FSDP2, compiled
regions), names unchanged, refused without whole-layer recompute; on a GPU, the inputs leave GPU memory in forward
and come back prefetched.

References: the same model under ``apply_recompute(model, ["full"])`` without offload (a deep copy, fresh random
weights and batches). On the CPU the hooks treat CPU tensors as offloadable (``cpu_tensors=True``, ``min_bytes=0``).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from v4_helpers import build, gloo_spawn, packed_batch, tiny_args

from v4launch.model.parallel import offload
from v4launch.model.parallel.offload import apply_activation_offload, offload_stats, offloaded_blocks, reset_offload_stats
from v4launch.model.parallel.recompute import FULL_LAYER, apply_recompute

LENGTHS = [37, 140, 21]
BLOCKS = ["layers.0", "layers.1", "layers.2", "layers.3", "mtp.0"]  # tiny_args: 4 layers + 1 MTP layer


def total(out) -> torch.Tensor:
    return out.lm_loss + sum(out.aux_losses.values())


def _pair(gen, phase="sparse", dtype=torch.float64, device="cpu", args=None, **offload_kw):
    """(full recompute, full recompute + offload): the same weights."""
    ref = build(args or tiny_args(), phase, gen, dtype=dtype, chunk_size=16).to(device)
    apply_recompute(ref, [FULL_LAYER])
    off = copy.deepcopy(ref)
    kw = dict(min_bytes=0, cpu_tensors=True) if device == "cpu" else {}
    kw["mtp_inputs"] = False  # the block inputs only; test_mtp_inputs_offloaded_too covers mtp_input
    a = ref.args
    want = [f"layers.{i}" for i in range(a.n_layers)] + [f"mtp.{k}" for k in range(a.n_mtp_layers)]
    assert apply_activation_offload(off, **{**kw, **offload_kw}) == want
    return ref, off


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_bitwise(ref, off) -> None:
    want, got = _grads(ref), _grads(off)
    assert set(got) == set(want) and want
    differ = [n for n, g in got.items() if not torch.equal(g, want[n])]
    assert not differ, differ


@pytest.mark.parametrize("phase", ["dense", "sparse"])
def test_gradients_bitwise_equal_and_copies_prefetched(phase, gen):
    ref, off = _pair(gen, phase)
    batch = packed_batch(LENGTHS, ref.args.vocab_size, gen)
    reset_offload_stats()
    want = total(ref(*batch))
    want.backward()
    got = total(off(*batch))
    after_forward = offload_stats()
    got.backward()
    assert torch.equal(got, want)
    _assert_bitwise(ref, off)
    s = offload_stats()
    T, hc, dim = len(batch[0]), ref.args.hc_mult, ref.args.dim
    assert after_forward.forwards == 1 and after_forward.offloaded_tensors == len(BLOCKS)
    assert after_forward.offloaded_bytes == after_forward.last_forward_bytes == len(BLOCKS) * T * hc * dim * 8
    assert after_forward.host_bytes == after_forward.peak_host_bytes == after_forward.offloaded_bytes
    # kept: the int64 token ids, and where torch's checkpoint saves an empty placeholder tensor (torch 2.11), that
    assert after_forward.kept_tensors in (len(BLOCKS), 2 * len(BLOCKS))
    # backward: mtp.0 (the last call) copies back late and prefetches layers.3, which prefetches layers.2, ...
    assert (s.late, s.prefetched) == (1, len(BLOCKS) - 1)
    assert s.host_bytes == 0  # autograd dropped every host copy after backward


def test_packs_exactly_the_block_inputs(gen, monkeypatch):
    """Each layer call packs its checkpoint's tensor inputs once: the streams (moved) and the token ids (kept)."""
    ref, off = _pair(gen)
    inputs, packed = [], []
    for name in BLOCKS:
        off.get_submodule(name).register_forward_pre_hook(
            lambda m, args, _n=name: inputs.append((_n, [(a.shape, a.dtype, a.data_ptr()) for a in args
                                                         if isinstance(a, torch.Tensor)])))
    pack = offload._ENGINE.pack

    def recording(group, t):
        out = pack(group, t)
        packed.append((t.shape, t.dtype, t.data_ptr(), isinstance(out, torch.Tensor)))
        return out
    monkeypatch.setattr(offload._ENGINE, "pack", recording)
    total(off(*packed_batch(LENGTHS, ref.args.vocab_size, gen))).backward()
    assert [n for n, _ in inputs] == BLOCKS
    want = [(*t, t[1] != torch.float64) for _, ts in inputs for t in ts]  # float64 streams moved, int64 ids kept
    placeholders = [p for p in packed if p[0].numel() == 0]  # torch 2.11's checkpoint saves an empty tensor too
    assert all(p[3] for p in placeholders) and len(placeholders) in (0, len(BLOCKS))
    packed = [p for p in packed if p[0].numel() > 0]
    assert packed == want and len(packed) == 2 * len(BLOCKS)
    assert [tuple(p[0]) for p in packed[::2]] == [(sum(LENGTHS), 2, 32)] * len(BLOCKS)


def test_mtp_inputs_offloaded_too(gen):
    """With ``mtp_inputs`` (the job's setting) an MTP layer's ``mtp_input`` call packs exactly what it saves for
    backward (counted here by plain saved-tensor hooks around the reference's call), as one more link of the chain
    before the MTP block; gradients stay bitwise."""
    ref, off = _pair(gen)
    apply_activation_offload(off, min_bytes=0, cpu_tensors=True, mtp_inputs=True)
    layer = ref.mtp[0]
    saved = []
    method = type(layer).mtp_input

    def counting(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            return method(self, *args, **kwargs)
    layer.mtp_input = counting.__get__(layer)
    batch = packed_batch(LENGTHS, ref.args.vocab_size, gen)
    total(ref(*batch)).backward()
    reset_offload_stats()
    total(off(*batch)).backward()
    s = offload_stats()
    # what offload moves: plain floating contiguous tensors (not the weights, which the layer's GEMMs save too)
    moved = [t for t in saved if type(t) is torch.Tensor and t.is_floating_point() and t.is_contiguous() and t.numel()]
    assert moved and s.forwards == 1 and s.offloaded_tensors == len(BLOCKS) + len(moved)
    # backward: mtp.0's block (the last call) copies back late and prefetches layers.3 (past mtp_input, whose
    # tensors come back late, at their own unpack, after the block's re-run), layers.3 prefetches layers.2, ...
    assert (s.late, s.prefetched) == (1 + len(moved), len(BLOCKS) - 1) and s.host_bytes == 0
    _assert_bitwise(ref, off)


def test_interleaved_micro_batches_chain_per_forward(gen):
    """Two forwards, then their backwards in order (a pipeline's warm-up): each forward's chain prefetches its own
    layers; gradients bitwise those without offload."""
    ref, off = _pair(gen)
    batches = [packed_batch(LENGTHS, ref.args.vocab_size, gen), packed_batch([64, 50], ref.args.vocab_size, gen)]
    for model in (ref, off):
        reset_offload_stats()
        losses = [total(model(*b)) for b in batches]
        for loss in losses:
            loss.backward()
    s = offload_stats()
    assert s.forwards == 2 and s.offloaded_tensors == 2 * len(BLOCKS)
    assert (s.late, s.prefetched) == (2, 2 * (len(BLOCKS) - 1)) and s.host_bytes == 0
    _assert_bitwise(ref, off)


def test_no_grad_forward_packs_nothing(gen):
    _, off = _pair(gen)
    reset_offload_stats()
    with torch.no_grad():
        off(*packed_batch(LENGTHS, off.args.vocab_size, gen))
    assert offload_stats() == offload.OffloadStats()


@pytest.mark.parametrize("names", [[], ["layernorm", "moe_act"], ["moe"]], ids=lambda n: "+".join(n) or "none")
def test_refused_without_whole_layer_recompute(names, gen):
    model = build(tiny_args(), "dense", gen)
    apply_recompute(model, names)
    classes = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match="parallel.recompute_granularity") as exc:
        apply_activation_offload(model)
    assert "layers.0" in str(exc.value) and "Fix: set parallel.recompute_granularity=full" in str(exc.value)
    assert {n: type(m) for n, m in model.named_modules()} == classes and offloaded_blocks(model) == []


def test_names_unchanged_and_applying_twice_harmless(gen):
    plain = build(tiny_args(), "dense", gen)
    model = copy.deepcopy(plain)
    apply_recompute(model, [FULL_LAYER])
    assert apply_activation_offload(model, min_bytes=0, cpu_tensors=True, mtp_inputs=False) == BLOCKS
    classes = {n: type(m) for n, m in model.named_modules()}
    assert apply_activation_offload(model, min_bytes=0, cpu_tensors=True, mtp_inputs=False) == BLOCKS \
        == offloaded_blocks(model)
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert type(model.layers[0]).__name__ == "OffloadRecomputeBlock" and type(model.mtp[0]).__mro__[1].__name__ \
        == "RecomputeMTPLayer"
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    plain.load_state_dict(model.state_dict())  # strict: the keys match both ways
    twin = copy.deepcopy(model)  # a copy keeps the offload, on its own chain
    assert offloaded_blocks(twin) == BLOCKS
    reset_offload_stats()
    total(twin(*packed_batch(LENGTHS, twin.args.vocab_size, gen))).backward()
    s = offload_stats()
    assert (s.forwards, s.offloaded_tensors, s.late, s.prefetched) == (1, len(BLOCKS), 1, len(BLOCKS) - 1)


def test_small_tensors_and_cpu_tensors_kept_by_default(gen):
    _, off = _pair(gen, min_bytes=1 << 20)  # the streams here are ~50 KiB
    reset_offload_stats()
    total(off(*packed_batch(LENGTHS, off.args.vocab_size, gen))).backward()
    assert offload_stats().offloaded_tensors == 0 and offload_stats().kept_tensors in (2 * len(BLOCKS), 3 * len(BLOCKS))
    ref = build(tiny_args(), "dense", gen)
    apply_recompute(ref, [FULL_LAYER])
    apply_activation_offload(ref)  # CPU tensors are not moved without cpu_tensors
    reset_offload_stats()
    total(ref(*packed_batch(LENGTHS, ref.args.vocab_size, gen))).backward()
    assert offload_stats().offloaded_tensors == 0


def test_leaves_that_require_grad_kept(gen):
    """A parameter, or a pipeline stage's received input (a leaf its stage keeps for backward), is not moved: its
    owner keeps it alive, so a host copy would free nothing."""
    _, off = _pair(gen)
    group = offload._ENGINE.begin(off.layers[0].__dict__[offload._SLOT])
    leaf = torch.randn(8, 2, 32, dtype=torch.float64, requires_grad=True)
    reset_offload_stats()
    for t in (leaf, off.layers[0].hc_attn_fn):
        assert offload._ENGINE.pack(group, t) is t
    assert not isinstance(offload._ENGINE.pack(group, leaf * 2), torch.Tensor)  # an activation is moved
    assert (offload_stats().kept_tensors, offload_stats().offloaded_tensors) == (2, 1)


@pytest.mark.slow
def test_compiled_regions_bitwise_equal(gen):
    """compile_blocks after the offload (the seam's order): the compiled block bodies run inside the checkpoint,
    inside the hooks; gradients bitwise those of the compiled model without offload."""
    from v4launch.model.compile import compile_blocks

    torch._dynamo.reset()
    if torch.cuda.is_available():  # else compiling inside the checkpoint initialises CUDA, which checkpoint refuses
        torch.cuda.init()
    ref, off = _pair(gen, "dense", args=tiny_args(n_layers=2, compress_ratios=(0, 4, 0)))  # layers.0, layers.1, mtp.0
    for m in (ref, off):
        assert compile_blocks(m, backend="aot_eager") == 3
    batch = packed_batch([21, 11], ref.args.vocab_size, gen)
    total(ref(*batch)).backward()
    reset_offload_stats()
    total(off(*batch)).backward()
    s = offload_stats()
    assert (s.offloaded_tensors, s.late, s.prefetched) == (3, 1, 2)
    _assert_bitwise(ref, off)


def fsdp_case(case: dict) -> dict:
    """Both ranks: full recompute under FSDP2 (S = 2, dp 2), with and without offload (applied before FSDP)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torch.distributed.tensor import DTensor

    from v4launch.model.parallel.fsdp import apply_fsdp, routed_expert_params

    gen = torch.Generator().manual_seed(case["seed"])
    ref, off = _pair(gen)
    rank = torch.distributed.get_rank()
    batch = [packed_batch(LENGTHS, ref.args.vocab_size, gen) for _ in range(2)][rank]  # each rank its own batch
    out = {}
    for key, m in (("ref", ref), ("off", off)):
        apply_fsdp([m], None, dp=2, ignored_params=routed_expert_params([m]))
        reset_offload_stats()
        total(m(*batch)).backward()
        out[key] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).tolist()
                    for n, p in m.named_parameters() if p.grad is not None}
    s = offload_stats()
    out["stats"] = [s.offloaded_tensors, s.late, s.prefetched]
    out["names"] = [n for n, _ in off.named_parameters()] == [n for n, _ in ref.named_parameters()]
    return out


@pytest.mark.slow
def test_fsdp2_bitwise_equal(tmp_path):
    results = gloo_spawn(2, [dict(seed=int(torch.randint(0, 2**31 - 1, (1,))))], tmp_path, fsdp_case)
    for rank in results:
        r = rank[0]
        assert r["names"] and r["stats"] == [len(BLOCKS), 1, len(BLOCKS) - 1]
        assert r["ref"] and r["off"] == r["ref"]


# ------------------------------------------------------------------ GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_LENGTHS = [1500, 2596]  # T = 4096: each layer's streams [4096, 2, 32] float32 = 1 MiB


def _gpu_step(model, batch):
    """(loss, bytes allocated by the forward and still held after it)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = total(model(*batch))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), held


@cuda
def test_gpu_inputs_leave_gpu_memory_and_come_back_prefetched(gen):
    ref, off = _pair(gen, "dense", dtype=torch.float32, device="cuda")
    batch = [t.cuda() if isinstance(t, torch.Tensor) else t for t in packed_batch(GPU_LENGTHS, 61, gen)]
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        want, _ = _gpu_step(ref, batch)  # the first step also allocates the library workspaces
        grads_ref = {n: g.clone() for n, g in _grads(ref).items()}
        ref.zero_grad(set_to_none=True)
        again, held_ref = _gpu_step(ref, batch)
        reproducible = torch.equal(again, want) and all(torch.equal(g, grads_ref[n]) for n, g in _grads(ref).items())
        _gpu_step(off, batch)  # warm too: lazily built tables of its own
        off.zero_grad(set_to_none=True)
        reset_offload_stats()
        got, held_off = _gpu_step(off, batch)
    finally:
        torch.use_deterministic_algorithms(False)
    s = offload_stats()
    streams = sum(GPU_LENGTHS) * 2 * 32 * 4
    assert s.offloaded_tensors == len(BLOCKS) and s.offloaded_bytes == len(BLOCKS) * streams
    assert (s.late, s.prefetched) == (1, len(BLOCKS) - 1) and s.host_bytes == 0
    freed = held_ref - held_off  # the streams, each rounded up to the caching allocator's 512-byte blocks
    assert abs(freed - s.offloaded_bytes) <= 64 << 10, (held_ref, held_off, s)
    if not reproducible:
        pytest.skip("the reference step is not bitwise reproducible on this GPU; offload compared to it is not either")
    assert torch.equal(got, want)
    _assert_bitwise(ref, off)


@cuda
def test_gpu_capture_refused(gen):
    _, off = _pair(gen, "dense", dtype=torch.float32, device="cuda", min_bytes=0)
    h = torch.randn(64, 2, 32, device="cuda", requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), pytest.raises(RuntimeError, match="CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            group = offload._ENGINE.begin(off.layers[0].__dict__[offload._SLOT])
            offload._ENGINE.pack(group, h * 1)

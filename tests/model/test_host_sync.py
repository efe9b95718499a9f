"""Where the model reads device values on the host (a synchronisation on GPUs), counted on the CPU.

Every read of a tensor's value into Python (item / int / bool / float / tolist) and every
data-dependent shape (nonzero, boolean-mask indexing) during a forward + backward is recorded
with the model file that caused it. Allowed: packing.py's two reads per forward (cu_seqlens, free
when it is a CPU tensor, and check_ids' one combined range check), the reference attention's
per-chunk entry ranges (attention.py and packing.entry_range; the fused kernel path does not
use them) and moe.py (its
expert loop is being replaced by a grouped GEMM elsewhere). Nothing else: the losses, the KL
counts, the compressed-entry counts and the mHC mixing stay on the device.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from v4_helpers import build, packed_batch, tiny_args

_SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                 torch.ops.aten.masked_select.default}
_HOST_METHODS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
                 torch.Tensor.__float__, torch.Tensor.__index__}


def _model_file() -> str:
    """The innermost v4launch model file on the stack (e.g. 'packing.py:make_pack')."""
    for frame in reversed(traceback.extract_stack()):
        if "/model/" in frame.filename and "/tests/" not in frame.filename:
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
    return "outside the model"


class _Reads(TorchDispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if func in _SCALAR_READS or bool_index:
            self.seen[_model_file()] += 1
        return func(*args, **kwargs)


class _Methods(TorchFunctionMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:  # tolist reads without a dispatcher op on the CPU
            self.seen[_model_file()] += 1
        return func(*args, **(kwargs or {}))


def test_only_the_stated_host_reads_remain_in_a_training_step(gen):
    model = build(tiny_args(), "sparse", gen, dtype=torch.float32)
    tokens, cu, max_seqlen, labels = packed_batch([37, 20, 9], model.args.vocab_size, gen)
    seen: collections.Counter = collections.Counter()
    with _Methods(seen), _Reads(seen):
        out = model(tokens, cu, max_seqlen, labels)
        loss = out.lm_loss + sum(out.aux_losses.values())
        loss.backward()
        model.update_router_bias(1e-3)  # the aux-loss-free bias step reads nothing either
    print(dict(seen))
    files = {where.split(":")[0] for where in seen}
    assert files <= {"packing.py", "attention.py", "moe.py"}, dict(seen)
    assert not any(k.startswith("moe.py:update_bias") for k in seen), dict(seen)
    packing = {k: v for k, v in seen.items() if k.startswith("packing.py")}
    # make_pack reads cu_seqlens once, check_ids its one combined range check; entry_range serves the
    # reference attention's chunks only; compress_plan (entry counts) reads nothing
    assert packing.pop("packing.py:make_pack") == 1 and packing.pop("packing.py:check_ids") == 1
    assert set(packing) <= {"packing.py:entry_range"}, packing


def _kl_reference(teacher_logits, student, valid):
    """The per-row loop: rows without a valid candidate are skipped."""
    total, rows = student.sum() * 0.0, 0
    for r in range(student.shape[0]):
        v = valid[r]
        if not v.any():
            continue
        p_t = teacher_logits[r][:, v].softmax(-1).mean(0)
        log_p_s = student[r][v].log_softmax(-1)
        total = total + (p_t * (p_t.log() - log_p_s)).sum()
        rows += 1
    return total, rows


def test_masked_kl_matches_the_row_loop_and_gives_finite_gradients(gen):
    from v4launch.model.indexer import kl_teacher_student

    R, H, K = 6, 3, 5
    teacher = torch.randn(R, H, K, generator=gen, dtype=torch.float64)
    student = torch.randn(R, K, generator=gen, dtype=torch.float64, requires_grad=True)
    valid = torch.rand(R, K, generator=gen) < 0.6
    valid[1] = False  # a row without candidates
    valid[2] = True
    got, n = kl_teacher_student(teacher, student, valid)
    ref, n_ref = _kl_reference(teacher, student, valid)
    assert isinstance(n, torch.Tensor) and int(n) == n_ref
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(got, student)
    (g_ref,) = torch.autograd.grad(ref, student)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    none, n0 = kl_teacher_student(teacher, student, torch.zeros_like(valid))
    (g0,) = torch.autograd.grad(none, student)
    assert none.item() == 0.0 and int(n0) == 0 and torch.isfinite(g0).all() and not g0.any()


def test_the_warmup_kl_reads_its_chunk_ranges_once_per_layer(gen, monkeypatch):
    """The fused-kernel layer (kernels/layer.py, here over the reference functions as a stand-in backend) in the
    warm-up phase: the KL's query chunks read their entry ranges in ONE transfer per CSA layer
    (``warmup_chunks``), not two per chunk; the layer file reads nothing else."""
    import dataclasses

    from v4launch.model import model as model_module
    from v4launch.model.kernels import dispatch

    stand_in = dataclasses.replace(dispatch.select_backend("reference", "cpu"), name="triton")
    monkeypatch.setattr(model_module, "select_backend", lambda name, device: stand_in)
    model = build(tiny_args(), "warmup", gen, dtype=torch.float32, kernel_backend="triton")
    tokens, cu, max_seqlen, labels = packed_batch([37, 20, 9], model.args.vocab_size, gen)
    seen: collections.Counter = collections.Counter()
    with _Methods(seen), _Reads(seen):
        out = model(tokens, cu, max_seqlen, labels)
        (out.lm_loss + sum(out.aux_losses.values())).backward()
    indexed = sum(1 for m in model.modules() if getattr(m, "indexer", None) is not None)  # CSA layers
    layer = {k: v for k, v in seen.items() if k.startswith("layer.py")}
    assert indexed >= 1 and layer == {"layer.py:warmup_chunks": indexed}, (indexed, dict(seen))


def test_a_static_batch_warmup_kl_reads_nothing_on_the_host(gen, monkeypatch):
    """A static batch (``batch_context(static_seqlen=...)``, the step a CUDA graph captures) in the warm-up phase,
    the KL through ``layer._DenseKL`` (the stand-in backend says its kernels fuse it): its chunks come from host
    ints (``static_chunks``), so the layer file reads nothing; packing's own reads are those of building the
    context, outside the captured step."""
    import dataclasses

    from v4launch.model import model as model_module
    from v4launch.model.kernels import dispatch

    stand_in = dataclasses.replace(dispatch.select_backend("reference", "cpu"), name="triton",
                                   dense_kl_fused=lambda *a: True)
    monkeypatch.setattr(model_module, "select_backend", lambda name, device: stand_in)
    model = build(tiny_args(), "warmup", gen, dtype=torch.float32, kernel_backend="triton")
    tokens, cu, max_seqlen, labels = packed_batch([37, 20, 9, 30], model.args.vocab_size, gen)
    ctx = model.batch_context(tokens, cu, max_seqlen, labels, static_seqlen=48)
    seen: collections.Counter = collections.Counter()
    with _Methods(seen), _Reads(seen):
        out = model.forward_in(ctx, tokens, labels)
        (out.lm_loss + sum(out.aux_losses.values())).backward()
    assert "indexer_kl" in {k.split("/")[0] for k in out.aux_losses}, out.aux_losses.keys()
    assert not any(k.startswith("layer.py") for k in seen), dict(seen)

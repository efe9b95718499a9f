"""The model's one dispatch point: V4Model(kernel_backend=...) routes every attention layer
through kernels.layer.attention_forward when a fused backend is resolved, and keeps the
reference code otherwise (CPU, float64)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from v4_helpers import boundary_ties, fresh_gen, randomize, tiny_args
from v4launch.model import V4Model
from v4launch.model import model as model_module
from v4launch.model.kernels import dispatch, reference


def _batch(gen, vocab: int):
    cu = torch.tensor([0, 41, 47, 90])
    tokens = torch.randint(0, vocab, (90,), generator=gen)
    labels = tokens.roll(-1)
    labels[cu[1:] - 1] = -100
    return tokens, cu, labels


@pytest.mark.parametrize("phase", ["dense", "warmup", "sparse"])
def test_fused_backend_routes_through_kernel_layer(monkeypatch, phase):
    gen = fresh_gen()
    args = tiny_args(index_topk=3)
    for _ in range(20):  # redraw while a top-k boundary holds an exact tie: the two paths may pick either entry
        ref = V4Model(args, phase).double()
        randomize(ref, gen)
        tokens, cu, labels = _batch(gen, args.vocab_size)
        if phase == "dense" or boundary_ties(ref, (tokens, cu, 43, labels)) == 0:
            break
    else:
        pytest.fail("20 draws in a row held a top-k boundary tie")
    fused = V4Model(args, phase, kernel_backend="triton").double()
    fused.load_state_dict(ref.state_dict())
    calls = []
    base = dispatch.select_backend("reference", "cpu")
    # A stand-in "fused" backend made of the reference functions, counting its calls.
    counted = dataclasses.replace(
        base, name="triton",
        sparse_sink_attention=lambda *a, **k: (calls.append(1), base.sparse_sink_attention(*a, **k))[1])
    monkeypatch.setattr(model_module, "select_backend", lambda name, device: counted)
    out_ref = ref(tokens, cu, 43, labels)
    out_fused = fused(tokens, cu, 43, labels)
    assert calls, "the fused backend was never called"
    torch.testing.assert_close(out_fused.lm_loss, out_ref.lm_loss, rtol=1e-9, atol=1e-10)
    assert out_fused.aux_losses.keys() == out_ref.aux_losses.keys()
    for name in out_ref.aux_losses:
        torch.testing.assert_close(out_fused.aux_losses[name], out_ref.aux_losses[name], rtol=1e-9, atol=1e-10, msg=name)


def test_triton_on_cpu_runs_the_reference_path_and_says_why():
    gen = fresh_gen()
    args = tiny_args(index_topk=3)
    model = V4Model(args, "sparse", kernel_backend="triton").double()
    randomize(model, gen)
    tokens, cu, labels = _batch(gen, args.vocab_size)
    model(tokens, cu, 43, labels)
    assert "cpu: reference" in model.kernel_backend_reason


def test_unknown_backend_name_is_a_clear_error():
    with pytest.raises(ValueError, match="kernel_backend='flash'.*reference"):
        V4Model(tiny_args(), "dense", kernel_backend="flash")


def test_cudnn_backend_refuses_with_the_fix():
    model = V4Model(tiny_args(), "dense", kernel_backend="cudnn")
    tokens = torch.zeros(8, dtype=torch.long)
    with pytest.raises(dispatch.BackendUnavailable):
        model(tokens, torch.tensor([0, 8]), 8, tokens)


@pytest.mark.parametrize("phase", ["dense", "sparse"])
def test_range_bounds_given_to_the_kernels_bound_every_range(monkeypatch, phase):
    """The layer states the longest window and entry range on the host (``range_bounds``, which size the
    query-block backward's dS slots without reading the ranges): every call's ranges must fit them, range 1 only
    where the layer passes entries as a range (HCA; CSA in the dense phase), none beside index columns, whose
    span (largest - smallest column + 1) the entry bound then holds. Random
    packs: segments of random lengths, longer than the window, one with a ratio-128 entry."""
    gen = fresh_gen()
    args = tiny_args(index_topk=3)
    model = V4Model(args, phase, kernel_backend="triton").double()
    randomize(model, gen)
    calls = []
    base = dispatch.select_backend("reference", "cpu")

    def attn(q, kv, idx, sink, scale, ranges=None, range_bounds=None):
        calls.append((idx, ranges.clone(), range_bounds))
        return base.sparse_sink_attention(q, kv, idx, sink, scale, ranges)

    monkeypatch.setattr(model_module, "select_backend",
                        lambda name, device: dataclasses.replace(base, name="triton", sparse_sink_attention=attn))
    for _ in range(3):
        lengths = torch.randint(1, 300, (4,), generator=gen)
        lengths[0] = 128 + lengths[0] % 100  # one segment with a ratio-128 entry
        cu = torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0)))
        tokens = torch.randint(0, args.vocab_size, (int(cu[-1]),), generator=gen)
        labels = tokens.roll(-1)
        labels[cu[1:] - 1] = -100
        model(tokens, cu, int(lengths.max()), labels)
    assert calls
    kinds = set()
    for idx, ranges, (window, entries) in calls:
        lengths = (ranges[:, 1::2] - ranges[:, 0::2]).clamp_min(0)
        assert int(lengths[:, 0].max()) <= window == args.window_size
        assert int(lengths[:, 1].max()) <= entries
        if idx is not None:  # range 1 empty; the bound holds each query's column span (largest - smallest + 1)
            valid = idx >= 0
            span = torch.where(valid, idx, -1).amax(1) + 1 - torch.where(valid, idx, 2**30).amin(1)
            assert int(lengths[:, 1].max()) == 0 and int(span[valid.any(1)].max()) <= entries
        kinds.add("idx" if idx is not None else "entries" if entries else "window")
    assert kinds >= ({"window", "entries", "idx"} if phase == "sparse" else {"window", "entries"}), kinds


def test_fused_warmup_kl_has_the_reference_value_and_indexer_gradients(monkeypatch):
    """The warm-up KL on a kernel backend (``layer._DenseKL``: the teacher and student over every visible entry as
    a selection, row chunks of a few rows, the gradient formed in the forward) against the reference path's
    chunked einsums, float64, random packs: the same KL per layer and the same gradient in every indexer parameter,
    and no gradient outside the indexers (the teacher is detached). The stand-in backend runs the reference
    teacher and student functions; the Triton kernels themselves are held to float64 in test_kernels_triton."""
    from v4launch.model.kernels import layer

    gen = fresh_gen()
    args = tiny_args(index_topk=3)
    ref = V4Model(args, "warmup").double()
    randomize(ref, gen)
    fused = V4Model(args, "warmup", kernel_backend="triton").double()
    fused.load_state_dict(ref.state_dict())
    base = dispatch.select_backend("reference", "cpu")
    chunks_seen = []
    warmup_chunks = layer.warmup_chunks

    def small_chunks(first, nvis, rows_per):  # a few rows per chunk: many chunks, segments split across them
        chunks_seen.append(warmup_chunks(first, nvis, 7))
        return chunks_seen[-1]

    monkeypatch.setattr(layer, "warmup_chunks", small_chunks)
    fused_backend = dataclasses.replace(base, name="triton", dense_kl_fused=lambda *a: True)
    monkeypatch.setattr(model_module, "select_backend", lambda name, device: fused_backend)
    tokens, cu, labels = _batch(gen, args.vocab_size)
    kl, weights = {}, torch.rand(2, generator=gen, dtype=torch.float64) + 0.5  # one weight per CSA layer's KL
    for name, model in (("ref", ref), ("fused", fused)):
        out = model(tokens, cu, 43, labels)
        kl[name] = {k: v for k, v in out.aux_losses.items() if k.startswith("indexer_kl/")}
        sum(w * v for w, v in zip(weights, kl[name].values())).backward()
    assert chunks_seen and max(len(c) for c in chunks_seen) >= 5
    assert kl["ref"].keys() == kl["fused"].keys() and len(kl["ref"]) == 2
    for k in kl["ref"]:
        torch.testing.assert_close(kl["fused"][k], kl["ref"][k], rtol=1e-10, atol=1e-12, msg=k)
    with torch.no_grad():  # evaluation: the value alone, no gradient formed
        evaluated = fused(tokens, cu, 43, labels).aux_losses
    for k in kl["ref"]:
        torch.testing.assert_close(evaluated[k], kl["ref"][k].detach(), rtol=1e-10, atol=1e-12, msg=k)
    grads = dict(fused.named_parameters())
    for name, p in ref.named_parameters():
        g_fused = grads[name].grad
        if ".indexer." in name:
            assert p.grad is not None and g_fused is not None, name
            torch.testing.assert_close(g_fused, p.grad, rtol=1e-9, atol=1e-12, msg=name)
        else:
            assert g_fused is None or not g_fused.any(), name


def test_fused_warmup_kl_under_whole_layer_recompute_runs_teacher_and_student_once(monkeypatch):
    """Under whole-layer recompute (a non-reentrant checkpoint around each block) the fused warm-up KL forms its
    value and gradient in the first pass and keeps the gradient on its autograd node, and the replay skips it: the
    teacher and the student run once per chunk and step, in the forward, none in the backward's recompute (before,
    the replay ran both again to form the gradient: at Flash width the warm-up step was 1.66x the sparse step). The
    student's own graph must not go through the checkpoint's saved-tensor hooks, which would rerun the whole layer
    to unpack it (at Flash width that held the layer twice and ran out of memory on an H200). The same values and
    gradients as without recompute."""
    from v4launch.model.parallel.recompute import apply_recompute, modules_from_recipe

    gen = fresh_gen()
    args = tiny_args(index_topk=3)
    plain = V4Model(args, "warmup", kernel_backend="triton").double()
    randomize(plain, gen)
    recomputed = V4Model(args, "warmup", kernel_backend="triton").double()
    recomputed.load_state_dict(plain.state_dict())
    apply_recompute(recomputed, modules_from_recipe("full", []))
    base = dispatch.select_backend("reference", "cpu")
    calls, with_grad, teachers = [0], [0], [0]

    def student(q, w, keys, sel):
        calls[0] += 1
        with_grad[0] += q.requires_grad
        return base.student_scores(q, w, keys, sel)

    def teacher(q, kv, lo, n_visible, width, scale):
        teachers[0] += 1
        return base.head_avg_probs(q, kv, reference.range_selection(lo, n_visible, width), scale)

    monkeypatch.setattr(model_module, "select_backend", lambda name, device: dataclasses.replace(
        base, name="triton", student_scores=student, dense_head_avg_probs=teacher,
        dense_kl_fused=lambda *a: True))
    tokens, cu, labels = _batch(gen, args.vocab_size)
    counts, values = [], []
    for model in (plain, recomputed):
        calls[0] = with_grad[0] = teachers[0] = 0
        out = model(tokens, cu, 43, labels)
        in_forward = calls[0], with_grad[0], teachers[0]
        kl = {k: v for k, v in out.aux_losses.items() if k.startswith("indexer_kl/")}
        sum(kl.values()).backward()
        counts.append((in_forward, (calls[0] - in_forward[0], with_grad[0] - in_forward[1], teachers[0] - in_forward[2])))
        values.append({k: v.detach() for k, v in kl.items()})
    n = counts[0][0][0]  # one student and one teacher call per chunk; each CSA layer has at least one chunk
    assert n >= 2 and counts == [((n, n, n), (0, 0, 0))] * 2, counts
    for k in values[0]:
        torch.testing.assert_close(values[1][k], values[0][k], rtol=1e-12, atol=0.0, msg=k)
    grads = dict(recomputed.named_parameters())
    for name, p in plain.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-10, atol=1e-13, msg=name)


def test_warmup_kl_keeps_the_chunked_path_where_the_kernels_do_not_run(monkeypatch):
    """A backend whose teacher or student would fall back to the reference functions (which gather [rows, entries,
    D] per chunk: ~128 GiB for 4,096 rows of a float32 Flash-width warm-up) says so through ``dense_kl_fused``,
    and the warm-up KL then runs ``layer._warmup_kl``'s bounded chunks, with the same value."""
    gen = fresh_gen()
    args = tiny_args(index_topk=3)
    model = V4Model(args, "warmup", kernel_backend="triton").double()
    randomize(model, gen)
    base = dispatch.select_backend("reference", "cpu")
    assert not base.dense_kl_fused(None, None, None, None)
    students = []
    stand_in = dataclasses.replace(base, name="triton",
                                   student_scores=lambda *a: (students.append(1), base.student_scores(*a))[1])
    monkeypatch.setattr(model_module, "select_backend", lambda name, device: stand_in)
    tokens, cu, labels = _batch(gen, args.vocab_size)
    chunked = model(tokens, cu, 43, labels).aux_losses
    assert not students  # the chunked einsums, not the backend's student
    fused = dataclasses.replace(stand_in, dense_kl_fused=lambda *a: True)
    monkeypatch.setattr(model_module, "select_backend", lambda name, device: fused)
    model.set_kernel_backend("triton")  # drops the cached backend
    out = model(tokens, cu, 43, labels).aux_losses
    assert students
    for k in chunked:
        torch.testing.assert_close(out[k], chunked[k], rtol=1e-10, atol=1e-12, msg=k)

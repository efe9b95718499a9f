"""Operator counts of one training step (forward + backward + optimizer), per module kind, on the CPU.

    python benchmarks/step_ops.py                        # sparse phase, kernels path, bf16
    python benchmarks/step_ops.py --phase dense --path reference --top 30
    python benchmarks/step_ops.py --by-function          # forward ops per model function as well
    python benchmarks/step_ops.py --json $OUT/ops.json
    V4_MODEL_DIR=/tmp/old/model python benchmarks/step_ops.py   # count an older snapshot of model/
    python benchmarks/step_ops.py --compile aot_eager    # operators left outside the compiled blocks

Why: the GPU training step (benchmarks/train_step.py) is host-bound, so the number of operators the
host dispatches per step is the figure to drive down, and it hardly depends on the device. This
counts them on the CPU for the benchmark's model structure at a reduced width (issue 17).

Model: train_step.py's structure (8 layers SWA/CSA/HCA/... + 1 MTP, 16 heads, 24 routed experts
top-4 + 1 shared, mHC 4, hash layer 0) at reduced sizes (dim 256, head_dim 64, vocab 4096),
bf16 parameters (hc_*, ape, sinks FP32-pinned), ``--tokens`` packed as segments of ``--seg``.
One step = forward, backward of the benchmark's total loss, fused AdamW step, zero_grad,
router-bias update. Counted on the second step (the first builds lazy state).

What runs as it would on an SM90 GPU (``--gpu-like``, default on):
  * routed experts: the grouped-GEMM path (``torch._grouped_mm`` runs on the CPU too);
  * wide products (bf16 operands, float32 output): one operator, as ``torch.mm(..., out_dtype)``
    on CUDA (the CPU build lacks it and would add two casts);
  * kernels path: each call of a fused attention kernel (``sparse_sink_attention``, its backward,
    ``indexer_topk``, ``head_avg_probs``) counts as ONE operator (``kernel:*`` rows); the
    reference functions compute the values.
  * the mHC mixing after its projection (``mhc.hc_pre_tail``, ``mhc.hc_post_fused``), a
    ``torch.compile``d region on CUDA, counts as one operator forward and one backward
    (``kernel:mhc_*``; inductor makes a few kernels of each).

Counting: a TorchDispatchMode sees every aten operator below autograd. Views and allocations
(``is_view``, ``detach``, ``empty*``) are listed apart, as they launch no kernel. An operator is
attributed to the innermost module kind running it: in forward through module hooks, in backward
through the autograd node that runs it (each node is tagged with the module that created it).
``--by-function`` also attributes forward operators to the innermost function in model/.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import load_model_package  # noqa: E402

PACKAGE = load_model_package()  # $V4_MODEL_DIR (e.g. an older snapshot of model/ for a before/after count)
from v4launch.model import ModelArgs, V4Model  # noqa: E402
from v4launch.model import matmul as matmul_mod  # noqa: E402
from v4launch.model import mhc as mhc_mod  # noqa: E402
from v4launch.model import moe as moe_mod  # noqa: E402
from v4launch.model.attention import Attention  # noqa: E402
from v4launch.model.kernels import attention_forward, select_backend  # noqa: E402

RATIOS = (0, 4, 128, 4, 128, 4, 128, 4, 0)
NO_LAUNCH = {"detach", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
             "_unsafe_view", "alias", "set_", "resize_", "_to_copy_noop"}
SYNC = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}
TAG = "step_ops_kind"
MODEL_DIR = str(Path(PACKAGE.__file__).parent)


def make_args(vocab: int) -> ModelArgs:
    """train_step.py's structure at reduced width (see the module docstring)."""
    return ModelArgs(vocab_size=vocab, dim=256, n_layers=8, n_mtp_layers=1, compress_ratios=RATIOS,
                     n_heads=16, head_dim=64, rope_head_dim=32, q_lora_rank=128, o_groups=4, o_lora_rank=64,
                     window_size=128, index_n_heads=16, index_head_dim=32, index_topk=64, n_routed_experts=24,
                     n_activated_experts=4, moe_inter_dim=256, n_hash_layers=1, hc_mult=4)


# ----------------------------------------------------------------------------- the counter
class OpCounter(TorchDispatchMode):
    """Counts aten operators by (module kind, forward/backward, operator name)."""

    def __init__(self, model: torch.nn.Module, by_function: bool) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.functions: collections.Counter = collections.Counter()
        self.by_function = by_function
        self.stack: list[str] = ["V4Model"]
        self.kernel_depth = 0
        self.counting = False
        self.hooks = []
        for module in model.modules():
            self.hooks.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self.hooks.append(module.register_forward_hook(self._leave, with_kwargs=True))
        self._boundaries: list[set[int]] = []

    def close(self) -> None:
        for h in self.hooks:
            h.remove()

    # forward attribution: a module stack; nodes created inside a module are tagged with its kind
    def _enter(self, module, args, kwargs):
        self.stack.append(type(module).__name__)
        flat, _ = tree_flatten((args, kwargs))
        self._boundaries.append({id(t.grad_fn) for t in flat if isinstance(t, torch.Tensor) and t.grad_fn is not None})

    def _leave(self, module, args, kwargs, output):
        kind, boundary = self.stack.pop(), self._boundaries.pop()
        flat, _ = tree_flatten(output)
        todo = [t.grad_fn for t in flat if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or id(node) in boundary or TAG in node.metadata:
                continue
            node.metadata[TAG] = kind
            todo.extend(n for n, _ in node.next_functions)

    def _where(self) -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        if node is None:
            return self.stack[-1], "fwd"
        if type(node).__name__ == "AccumulateGrad":
            return "grad accumulation", "bwd"
        return node.metadata.get(TAG, "V4Model"), "bwd"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.kernel_depth or not self.counting:
            return _run(func, name, args, kwargs)
        kind, phase = self._where()
        cls = "view" if func.is_view or name in NO_LAUNCH else ("sync" if name in SYNC else "op")
        self.counts[(kind, phase, cls, name)] += 1
        if self.by_function and phase == "fwd" and cls != "view":
            self.functions[_model_function()] += 1
        return _run(func, name, args, kwargs)

    def count_kernel(self, name: str) -> None:
        kind, phase = self._where()
        self.counts[(kind, phase, "op", f"kernel:{name}")] += 1


GEMMS = {"mm", "bmm", "addmm", "baddbmm", "_grouped_mm"}


def _run(func, name: str, args, kwargs):
    """Run the operator; bf16 GEMMs in float32 and rounded back (the CPU's bf16 GEMM is ~30x slower)."""
    kwargs = kwargs or {}
    if name in GEMMS and any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in args):
        up = [t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t for t in args]
        return func(*up, **kwargs).to(torch.bfloat16)
    return func(*args, **kwargs)


def _model_function() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(MODEL_DIR):
            return f"{path[len(MODEL_DIR) + 1:]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside model/)"


COUNTER: list[OpCounter] = []


class _OneKernel(torch.autograd.Function):
    """Runs ``fn`` (a reference kernel) as one counted operator forward and one backward."""

    @staticmethod
    def forward(ctx, name, fn, n_in, *flat):
        args = list(flat[:n_in])
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        _count(name)
        with _quiet(name), torch.enable_grad():
            for i in tensors:
                args[i] = args[i].detach().requires_grad_(flat[i].requires_grad)
            outs = fn(*args)
        ctx.name, ctx.inputs, ctx.outs = name, [args[i] for i in tensors], outs
        ctx.where = tensors
        ctx.n_in = n_in
        return tuple(None if o is None else o.detach() for o in outs) if isinstance(outs, tuple) else outs.detach()

    @staticmethod
    def backward(ctx, *grads):
        _count(ctx.name + "_bwd")
        outs = ctx.outs if isinstance(ctx.outs, tuple) else (ctx.outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o is not None and o.requires_grad]
        need = [t for t in ctx.inputs if t.requires_grad]
        with _quiet(ctx.name + "_bwd"):
            got = torch.autograd.grad([o for o, _ in pairs], need, [g for _, g in pairs], allow_unused=True) \
                if pairs and need else [None] * len(need)
        by_input = dict(zip(map(id, need), got))
        result = [None] * ctx.n_in
        for i, t in zip(ctx.where, ctx.inputs):
            result[i] = by_input.get(id(t))
        return (None, None, None, *result)


class _quiet:
    """Inside one counted kernel: the counter skips its operators; the profiler sees a ``kernel:*`` range."""

    def __init__(self, name: str) -> None:
        self.range = torch.profiler.record_function(f"kernel:{name}")

    def __enter__(self):
        if COUNTER:
            COUNTER[0].kernel_depth += 1
        self.range.__enter__()

    def __exit__(self, *exc):
        self.range.__exit__(*exc)
        if COUNTER:
            COUNTER[0].kernel_depth -= 1


def _count(name: str) -> None:
    if COUNTER and COUNTER[0].counting and not COUNTER[0].kernel_depth:
        COUNTER[0].count_kernel(name)


def one_kernel_backend():
    """The reference backend with each function counted as one fused kernel call."""
    base = select_backend("reference", "cpu")

    def wrap(name, fn, differentiable):
        @torch.compiler.disable  # counted in Python at every call: never traced
        def call(*args):
            if differentiable:
                return _OneKernel.apply(name, fn, len(args), *args)
            _count(name)
            with _quiet(name):
                return fn(*args)
        return call

    return dataclasses.replace(base, name="triton", requested="triton",
                               reason="step_ops: reference values, counted as kernels",
                               sparse_sink_attention=wrap("sparse_sink_attention", base.sparse_sink_attention, True),
                               indexer_topk=wrap("indexer_topk", base.indexer_topk, False),
                               head_avg_probs=wrap("head_avg_probs", base.head_avg_probs, False),
                               student_scores=wrap("student_scores", base.student_scores, True))


# ----------------------------------------------------------------------------- GPU-like paths
def gpu_like() -> None:
    """Take the SM90 code paths where the CPU can (see the module docstring)."""
    moe_mod.grouped_mm_applies = lambda x, dim, inter: (moe_mod._compute_dtype(x) == torch.bfloat16
                                                         and dim % 8 == 0 and inter % 8 == 0)
    lib = torch.library.Library("step_ops", "DEF")
    lib.define("mm_wide(Tensor a, Tensor b, ScalarType out_dtype) -> Tensor")
    lib.impl("mm_wide", lambda a, b, out_dtype: (a.float() @ b.float()).to(out_dtype), "CPU")
    lib.impl("mm_wide", lambda a, b, out_dtype: a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype), "Meta")
    gpu_like.lib = lib  # keep the registration alive
    plain = matmul_mod.mm_wide

    def mm_wide(a, b, out_dtype):
        if out_dtype == a.dtype or a.is_cuda:
            return plain(a, b, out_dtype)
        return torch.ops.step_ops.mm_wide(a, b, out_dtype)
    matmul_mod.mm_wide = mm_wide
    for mod in list(sys.modules.values()):  # modules that imported the name
        if getattr(mod, "mm_wide", None) is plain and mod is not matmul_mod:
            mod.mm_wide = mm_wide
    # the mHC tail / post mixing: one compiled region each on CUDA (mhc._compiled)
    mhc_mod._fused_here = lambda t: mhc_mod._FUSED["on"] and t.dtype != torch.float64
    regions = {"pre": mhc_mod.hc_pre_tail, "post": mhc_mod.hc_post_fused}

    def compiled(which):
        if torch.compiler.is_compiling():  # inside a compiled block: the plain function, fused there
            return regions[which]
        return lambda *args: _OneKernel.apply(f"mhc_{which}", regions[which], len(args), *args)
    mhc_mod._compiled = compiled


# ----------------------------------------------------------------------------- the step
def build(a) -> tuple[V4Model, callable]:
    args = make_args(a.vocab)
    torch.manual_seed(0)
    model = V4Model(args, "dense")
    for later in ("warmup", "sparse")[: ("dense", "warmup", "sparse").index(a.phase)]:
        model.set_phase(later)
    model = model.to(torch.bfloat16)
    if a.path == "kernels":
        backend = one_kernel_backend()
        Attention.forward = lambda self, x, ctx: attention_forward(self, x, ctx, backend)
    g = torch.Generator().manual_seed(1)
    lengths = [a.seg] * (a.tokens // a.seg)
    tokens = torch.randint(0, args.vocab_size, (sum(lengths),), generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    labels = torch.cat([tokens[1:], tokens.new_full((1,), -100)])
    labels[cu[1:].long() - 1] = -100
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    if a.compile:
        from v4launch.model.compile import compile_blocks
        compile_blocks(model, backend=a.compile)

    def step():
        out = model(tokens, cu, max(lengths), labels)
        loss = out.lm_loss + sum((1.0 if k.startswith("indexer") else 0.01 if k.startswith("balance") else 0.3) * v
                                 for k, v in out.aux_losses.items())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias(1e-3)
    return model, step


def count_step(a) -> OpCounter:
    if a.gpu_like:
        gpu_like()
    model, step = build(a)
    counter = OpCounter(model, a.by_function)
    COUNTER.append(counter)
    with counter:
        step()  # not counted: lazy state (optimizer, caches) is built here
        counter.counting = True
        step()
    counter.close()
    return counter


def count_compiled(a) -> dict:
    """With ``--compile``: compile_blocks, two steps, then one profiled step. Aten operators are
    split into those inside torch.compile graphs (under a ``CompiledFunction*`` event; inductor fuses
    them) and those run eagerly; operators called by other operators are not counted. No module attribution (module hooks would be traced by dynamo)."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    if a.gpu_like:
        gpu_like()
    model, step = build(a)
    step()
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    eager, graphs = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.name.startswith("kernel:"):
            eager[e.name] += 1
            continue
        if e.name.startswith("step_ops::"):
            eager[e.name[len("step_ops::"):]] += 1
            continue
        if not e.name.startswith("aten::"):
            continue
        names, parent = [], e.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        if any(n.startswith(("aten::", "kernel:", "step_ops::")) for n in names):
            continue  # only operators called from Python (or from compiled graphs), as the dispatch counter
        op = e.name[len("aten::"):]
        if op in NO_LAUNCH or op in ("view", "as_strided", "transpose", "t", "expand", "unsqueeze", "squeeze",
                                     "slice", "select", "permute", "reshape", "flatten", "unflatten", "split",
                                     "narrow", "chunk", "unbind", "_reshape_alias", "view_as", "detach_"):
            continue
        (graphs if any("CompiledFunction" in n for n in names) else eager)[op] += 1
    return dict(eager=sum(eager.values()), in_graphs=sum(graphs.values()),
                unique_graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()),
                top_eager=eager.most_common(a.top), top_in_graphs=graphs.most_common(a.top))


# ----------------------------------------------------------------------------- report
def summarise(counter: OpCounter, top: int) -> dict:
    by_kind: dict = collections.defaultdict(lambda: collections.Counter())
    by_name: collections.Counter = collections.Counter()
    for (kind, phase, cls, name), n in counter.counts.items():
        by_kind[kind][f"{phase}_{cls}"] += n
        if cls != "view":
            by_name[name] += n
    totals = collections.Counter()
    for c in by_kind.values():
        totals.update(c)
    ops = lambda c: c["fwd_op"] + c["bwd_op"] + c["fwd_sync"] + c["bwd_sync"]  # noqa: E731
    return dict(kinds={k: dict(v, ops=ops(v)) for k, v in sorted(by_kind.items(), key=lambda kv: -ops(kv[1]))},
                total=dict(totals, ops=ops(totals)), top_ops=by_name.most_common(top),
                functions=counter.functions.most_common(top))


def print_report(s: dict, a) -> None:
    print(f"step_ops: phase {a.phase}, path {a.path}, {a.tokens} tokens ({a.tokens // a.seg} x {a.seg}), bf16, "
          f"{'GPU-like paths' if a.gpu_like else 'CPU paths'}{', compiled ' + a.compile if a.compile else ''}")
    head = f"{'module kind':22s} {'fwd ops':>8s} {'bwd ops':>8s} {'syncs':>6s} {'ops':>7s} {'views':>7s}"
    print(head + "\n" + "-" * len(head))
    for kind, c in list(s["kinds"].items()) + [("TOTAL", s["total"])]:
        print(f"{kind:22s} {c.get('fwd_op', 0):8d} {c.get('bwd_op', 0):8d} "
              f"{c.get('fwd_sync', 0) + c.get('bwd_sync', 0):6d} {c['ops']:7d} "
              f"{c.get('fwd_view', 0) + c.get('bwd_view', 0):7d}")
    print("\ntop operators (views excluded):")
    for name, n in s["top_ops"]:
        print(f"  {n:6d}  {name}")
    if s["functions"]:
        print("\nforward operators by model function:")
        for name, n in s["functions"]:
            print(f"  {n:6d}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", default="sparse", choices=["dense", "warmup", "sparse"])
    ap.add_argument("--path", default="kernels", choices=["kernels", "reference"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seg", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--cpu-paths", dest="gpu_like", action="store_false", help="keep the CPU's own code paths")
    ap.add_argument("--compile", default="", metavar="BACKEND", help="compile_blocks with this backend first")
    ap.add_argument("--by-function", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default="", metavar="FILE")
    a = ap.parse_args()
    if a.compile:
        s = count_compiled(a)
        print(f"step_ops: phase {a.phase}, path {a.path}, {a.tokens} tokens, compiled ({a.compile}): "
              f"{s['eager']} operators run eagerly, {s['in_graphs']} inside {s['unique_graphs']} compiled graphs "
              f"({s['graph_breaks']} graph breaks while compiling)")
        for title, key in (("eager", "top_eager"), ("inside compiled graphs", "top_in_graphs")):
            print(f"\ntop operators, {title}:")
            for name, n in s[key]:
                print(f"  {n:6d}  {name}")
    else:
        s = summarise(count_step(a), a.top)
        print_report(s, a)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(args=vars(a), **s), indent=1))


if __name__ == "__main__":
    main()

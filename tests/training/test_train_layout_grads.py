"""Every parameter's gradient under the combined layouts equals the one-process step's (the job's own step).

The workers run the training job unchanged; the test only records, at each optimizer step, every
parameter's gradient as the optimizer receives it (after the layout's reductions and the clip:
FSDP shards gathered with ``full_tensor``), keyed by FQN. The one-process run of the same recipe,
global batch and data is the reference. The recipe starts in the warm-up phase, so the MTP loss,
the balance loss and the indexer KL all reach the gradients; two optimizer steps are compared (the
second starts from weights the first step's optimizer updated under the layout).

Layouts (issue 16's parity list; ``ep`` folds over dp x cp inside each pipeline rank):
(pp 2, ep 2, dp 2) with FSDP, (pp 2 vpp 2, ep 2), (ep 2, cp 2), (pp 2, cp 2). Float64: <= 1e-10
relative per tensor at both steps (observed <= 1e-12); float32: the layout's first-step gradient against
the float64 truth within 1e-5, or for a tensor whose one-process float32 gradient is itself further than
that from the truth (a sum that cancels, e.g. ``mtp.0.hc_head_scale``: 1e-4 to 8e-4 relative depending on
rounding order), within 8x that one-process error, taken over the three parameters of one mHC mixing
(``_float32_noise``). The float32 second step is not compared: the optimizer
amplifies float32 rounding (Adam's
first update is ~sign(g) for entries near zero, Muon orthogonalises in bf16), so weights after one
step already differ by ~1e-3 relative in places whatever the layout (the same holds for CP alone:
test_train_cp.py).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

GRAD_WORKER = textwrap.dedent("""
    import sys, os
    import torch
    import v4launch.training.runner as runner
    import v4launch.training.optim as optim
    from torch.distributed.tensor import DTensor
    if sys.argv[2] == "float64":
        build = runner.V4Model
        runner.V4Model = lambda *a, **k: build(*a, **k).double()
    step = optim.Optimizers.step
    calls = [0]
    def recording_step(self, clip=None):  # the gradients as the update sees them: clipped
        calls[0] += 1
        names = {id(p): n for n, p in self._model_names}
        grads = {}
        for p in self.params:
            g = p.grad
            g = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
            grads[names[id(p)]] = (g if clip is None else g * clip.to(g.dtype)).cpu()
        torch.save(grads, os.path.join(sys.argv[1], f"grads_step{calls[0]}_rank{os.environ.get('RANK', '0')}.pt"))
        return step(self, clip=clip)
    init = optim.Optimizers.__init__
    def recording_init(self, model, cfg, **kw):
        init(self, model, cfg, **kw)
        self._model_names = list(model.named_parameters())
    add = optim.Optimizers.add_params
    def recording_add(self, model, named, tag):
        add(self, model, named, tag)
        self._model_names = list(model.named_parameters())
    optim.Optimizers.__init__, optim.Optimizers.add_params = recording_init, recording_add
    optim.Optimizers.step = recording_step
    from v4launch.training.job import train
    train(sys.argv[1], progress=False)
""")

WARM = [{"name": "warm", "seq_len": 256, "phase": "warmup", "steps": 2}]
WARM_CP2 = [dict(WARM[0], cp=2)]
LAYOUTS = {
    "pp2-ep2-dp2-fsdp": (4, {"cluster": {"gpus_per_node": 4}, "parallel": {
        "pp": 2, "pp_layout": "Et|ttmL", "ep": 2, "distributed_optimizer": True, "global_batch_size": 4}}, {}),
    "pp2vpp2-ep2": (4, {"cluster": {"gpus_per_node": 4}, "parallel": {
        "pp": 2, "vpp": 2, "pp_layout": "Et|t|t|mL", "ep": 2, "global_batch_size": 4}}, {}),
    "ep2-cp2": (2, {"cluster": {"gpus_per_node": 2}, "parallel": {"ep": 2}}, {"cp": 2}),
    "pp2-cp2": (4, {"cluster": {"gpus_per_node": 4}, "parallel": {"pp": 2, "pp_layout": "Et|ttmL"}}, {"cp": 2}),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(run: Path, world: int, dtype: str) -> None:
    env = dict(os.environ, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", GRAD_WORKER, str(run), dtype], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)


def _grads(run: Path, step: int) -> dict[str, list[torch.Tensor]]:
    """FQN -> the gradient every rank holding it recorded (ranks of an S group hold the same values)."""
    out: dict[str, list[torch.Tensor]] = {}
    for path in sorted(run.glob(f"grads_step{step}_rank*.pt")):
        for name, g in torch.load(path).items():
            out.setdefault(name, []).append(g)
    return out


def _mixing(name: str) -> str:
    """The mHC mixing a parameter belongs to: ``hc_<site>_fn`` / ``_base`` / ``_scale`` of one block share one
    name; any other parameter is its own."""
    return re.sub(r"_(fn|base|scale)$", "", name)


def _float32_noise(want: dict[str, list[torch.Tensor]], truth: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """Per mHC mixing (:func:`_mixing`): the largest relative error (max abs / the tensor's max abs) of the
    one-process float32 gradients against the float64 truth. The three parameters of one mixing take their
    gradients from the same per-token pre-activation gradients (base: their token sum; scale and fn: their
    products with the mixing's inputs), so they share one cancellation; a two-element base's own error is a single
    draw of it (mtp.0.hc_head_base: 1.1e-5 in one run, beside 1.2e-4 for its fn and 7.2e-4 for its scale) and
    too small a yardstick alone."""
    noise: dict[str, float] = {}
    for name, (ref_grad,) in want.items():
        scale = ref_grad.abs().max().item() or 1.0
        own = (ref_grad.double() - truth[name][0].double()).abs().max().item() / scale
        noise[_mixing(name)] = max(noise.get(_mixing(name), 0.0), own)
    return noise


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_gradient_equals_the_one_process_step(new_run, layout, dtype, tol):
    if dtype == "float32" and layout in ("pp2vpp2-ep2", "pp2-cp2"):
        pytest.skip("float32 runs on two layouts only (CI time): pp2-ep2-dp2-fsdp and ep2-cp2")
    world, over, stage_over = LAYOUTS[layout]
    model = {"model": {"n_layers": 3}} if "vpp" in over["parallel"] else {}
    stages = [dict(WARM[0], **stage_over)]
    run = new_run({**over, **model, "curriculum": {"stages": stages}})
    gbs = over["parallel"].get("global_batch_size", 2)
    ref = new_run({**model, "parallel": {"global_batch_size": gbs}, "curriculum": {"stages": WARM}}, name="ref")
    _run(ref, 1, dtype)
    _run(run, world, dtype)
    truth = None
    if dtype == "float32":  # the one-process float32 step's own rounding error, per tensor
        exact = new_run({**model, "parallel": {"global_batch_size": gbs}, "curriculum": {"stages": WARM}}, name="f64")
        _run(exact, 1, "float64")
        truth = _grads(exact, 1)
    for step in ((1, 2) if dtype == "float64" else (1,)):
        want, got = _grads(ref, step), _grads(run, step)
        assert set(got) == set(want), f"step {step}: parameters differ: {sorted(set(got) ^ set(want))[:5]}"
        assert any(".indexer." in n for n in want) and any(n.startswith("mtp.") for n in want)
        worst = ("", 0.0, 0.0)
        noise = _float32_noise(want, truth) if truth is not None else {}
        for name, (ref_grad,) in want.items():
            scale = ref_grad.abs().max().item() or 1.0
            allowed, target = tol, ref_grad
            if truth is not None:
                # float32: the layout's gradient against the float64 truth, within 8x the one-process float32
                # step's own error over the tensor's mixing (_float32_noise)
                target = truth[name][0]
                allowed = max(tol, 8 * noise[_mixing(name)])
            for g in got[name]:
                err = (g.double() - target.double()).abs().max().item() / scale
                if err / allowed > worst[1] / max(worst[2], 1e-300):
                    worst = (name, err, allowed)
        assert worst[1] <= worst[2] or not worst[0], \
            f"step {step}: worst gradient {worst[0]} relative error {worst[1]:.2e} > {worst[2]:.1e}"

"""``precision.params_dtype: bf16``: the job's conversion (model/parallel/storage.py) stores exactly the parameters the
memory plan counts as bf16 (validators/memory_plan.py via validators/storage_policy.py), on a freshly drawn model.

Also: the conversion keeps the Parameter objects (a pipeline view and EP's expert set hold them), FSDP-sharded
parameters stay fp32 except the routed experts FSDP ignores, the FP32-pinned ones never change, and a forward in
float32 compute with bf16 weights equals one with the same (bf16-representable) weights stored in fp32.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from pathlib import Path  # noqa: E402
from v4launch.model import V4Model  # noqa: E402
from v4launch.model.parallel.fsdp import routed_expert_params  # noqa: E402
from v4launch.model.parallel.storage import apply_param_storage  # noqa: E402
from v4launch.recipe_loading import load_recipe  # noqa: E402
from v4launch.training.model_adapter import model_args_from_recipe  # noqa: E402
from v4launch.training.master_weights import INITIAL_REMAINDER, join_master, split_master  # noqa: E402
from v4launch.validators.memory_storage import stored_low as _stored_low  # noqa: E402
from v4launch.validators.param_count import model_params  # noqa: E402

EXPERT = re.compile(r"^(.*\.ffn\.experts)\.\d+\.w[123]\.weight$")
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
PINNED = re.compile(r"(^|\.)(ape|attn_sink|hc_[a-z_]+|embed\.weight)$|norm\.weight$")


def _recipe(overrides: list[str]):
    return load_recipe(RECIPES / "tiny_cpu.yaml", ["precision.params_dtype=bf16", *overrides]).recipe


def _plan_low(recipe, phase: str) -> set[str]:
    return {s.name for s in model_params(recipe.model, phase) if _stored_low(recipe, s)}


def _spec_name(name: str) -> str:
    m = EXPERT.match(name)
    return f"{m.group(1)}.*" if m else name


@pytest.mark.parametrize("phase", ["dense", "sparse"])
@pytest.mark.parametrize("overrides, fsdp", [([], False), (["parallel.distributed_optimizer=true"], True),
                                             (["parallel.distributed_optimizer=true", "parallel.ep=2"], True)])
def test_the_job_stores_in_bf16_what_the_plan_counts(phase, overrides, fsdp):
    recipe = _recipe(overrides)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    model = V4Model(model_args_from_recipe(recipe), phase=phase)
    before = {n: p for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in before.items()}
    unsharded = routed_expert_params([model]) if recipe.parallel.ep > 1 else set()
    done = apply_param_storage(model, "bf16", fsdp=fsdp, unsharded=unsharded)
    low = {n for n, p in model.named_parameters() if p.dtype == torch.bfloat16}
    assert set(done) == low
    assert bool(low) == (not fsdp or recipe.parallel.ep > 1)  # FSDP without EP shards every matrix: none is bf16
    assert {_spec_name(n) for n in low} == _plan_low(recipe, phase)
    for n, p in model.named_parameters():
        assert p is before[n]  # the same Parameter: views and expert sets still hold it
        if n in low:  # the bf16 rounding (ties away) of the fp32 value, which the waiting remainder restores
            assert torch.equal(p.detach(), split_master(values[n])[0])
            initial = join_master(p.detach(), getattr(p, INITIAL_REMAINDER))
            assert torch.equal(initial.view(torch.int32), values[n].view(torch.int32))
        else:
            assert p.dtype == torch.float32 and torch.equal(p.detach(), values[n])
    assert not any(PINNED.search(n) for n in low)
    if fsdp:  # only the experts FSDP ignores may be bf16
        assert low == {n for n, p in model.named_parameters() if p in unsharded}


def test_fp32_storage_changes_nothing_and_a_bad_dtype_is_refused():
    model = V4Model(model_args_from_recipe(_recipe([])), phase="dense")
    assert apply_param_storage(model, "fp32", fsdp=False) == []
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="precision.params_dtype='fp16'.*Fix"):
        apply_param_storage(model, "fp16", fsdp=False)


def test_float32_compute_with_bf16_weights_equals_the_same_weights_in_fp32():
    args = model_args_from_recipe(_recipe([]))
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    model = V4Model(args, phase="sparse")
    with torch.no_grad():  # bf16-representable values, so both storages hold the same numbers
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    twin = V4Model(args, phase="sparse")
    twin.load_state_dict(model.state_dict())
    apply_param_storage(twin, "bf16", fsdp=False)
    T = 96
    tokens = torch.randint(0, args.vocab_size, (T,))
    cu = torch.tensor([0, 40, T], dtype=torch.int32)
    a, b = model(tokens, cu, 56, tokens), twin(tokens, cu, 56, tokens)
    torch.testing.assert_close(b.lm_loss, a.lm_loss, rtol=0, atol=0)

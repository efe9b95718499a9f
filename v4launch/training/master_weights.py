"""Exact fp32 master weights beside bf16 parameters (16-bit remainders), and bf16 optimizer-state storage.

Source: Megatron-LM's precision-aware optimizer (``--use-precision-aware-optimizer``; the names
``store_param_remainders``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``), reimplemented here with torch ops;
the update math itself stays ``torch.optim.AdamW``'s and :class:`muon.Muon`'s (see ``optim.py``, ``muon.py``).

Split of an fp32 master ``x`` (bit pattern ``s | m``: sign bit ``s``, 31-bit magnitude ``m``) into a bf16
value ``h`` and an int16 remainder ``r``::

    h = s | min((m + 0x8000) >> 16, 0x7FFF)       # bf16 bits: round to nearest, ties AWAY from zero
    r = m - ((h & 0x7FFF) << 16)                   # in [-0x8000, 0x7FFF]: fits int16 exactly
    x = (h << 16) + r  (as int32)                  # join: the same bits, for every non-NaN pattern

Why not round to nearest EVEN (what ``tensor.to(torch.bfloat16)`` does): under RNE an even bf16 value
``h`` is reached from 2^16 + 1 fp32 patterns, both ties ``h - 0x8000`` and ``h + 0x8000`` included (the
tie below rounds up to the even ``h``, the tie above rounds down to it), so their remainders -0x8000 and
+0x8000 collide in 16 bits: one of the two tie cases cannot be undone. Rounding ties away from zero in
magnitude gives each bf16 value exactly 2^16 preimages (magnitudes ``[h - 0x8000, h + 0x7FFF]``), one per
int16. So the bf16 parameter the model computes with is the master rounded to nearest (ties away), not
``master.to(bfloat16)``; both master variants (remainder, fp32 copy) use this rounding, so their bf16
parameters are bitwise equal. Edge cases: a finite master above the largest bf16 plus half an ulp
(|x| >= 3.3961e38) gives an inf ``h`` and still joins back exactly; a quiet NaN (what arithmetic
produces) gives a NaN ``h`` (a signalling NaN with only low mantissa bits may give inf); NaN patterns whose
magnitude is >= 0x7FFF8000 do not round-trip (the remainder does not fit); nothing raises.

Bytes per parameter (weight + gradient + optimizer state)::

    fp32 parameter, fp32 states        4 + 4 grad + 4 Muon momentum   (AdamW: + 4 + 4)
    bf16 parameter + int16 remainder   2 + 2 remainder + 2 grad + 4 Muon momentum (bf16 momentum: 2)
    bf16 parameter + fp32 master copy  2 + 4 copy      + 2 grad + 4 Muon momentum (bf16 momentum: 2)

Optimizer states (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``) stored in bf16 are
upcast to fp32 for the step and rounded back to nearest even (``copy_``) after it; the step's own update
uses the fp32 value before that rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

MASTER_REMAINDER = "master_remainder"
"""Optimizer-state key of a bf16 parameter's int16 remainder (shaped like the parameter)."""
MASTER_PARAM = "master_param"
"""Optimizer-state key of a bf16 parameter's fp32 master copy (shaped like the parameter)."""
INITIAL_REMAINDER = "_initial_master_remainder"
"""Attribute a parameter carries from :func:`store_in_bf16` until the optimizer makes its master state: the int16
remainder of the fp32 value it was built with, so the first master is that value, not its bf16 rounding."""
FIRST_MOMENT_KEYS = ("exp_avg", "momentum_buffer")
SECOND_MOMENT_KEYS = ("exp_avg_sq", "max_exp_avg_sq")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Recipe spelling (``precision.exp_avg_dtype`` ...) -> torch dtype."""

_MAGNITUDE = 0x7FFFFFFF
_SIGN16 = -0x8000  # 0xFFFF8000 as int32: the sign bit after an arithmetic shift by 16


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (``DTensor.to_local()``, a view: in-place writes change ``t``), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _high_bits(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 bits rounded ties-away, as int32 in [-0x8000, 0x7FFF]; the magnitude's remainder, int32)."""
    mag = bits & _MAGNITUDE
    hi = mag >> 16
    carry = mag >> 15
    carry &= 1  # bit 15: the dropped half is >= one half ulp -> round the magnitude up
    hi += carry
    hi.clamp_(max=0x7FFF)  # NaN magnitudes >= 0x7FFF8000 would carry into the sign bit
    mag -= torch.bitwise_left_shift(hi, 16, out=carry)  # the remainder, in place of the magnitude
    sign = torch.bitwise_right_shift(bits, 16, out=carry)
    sign &= _SIGN16
    hi |= sign
    return hi, mag


def _check_master(master: torch.Tensor) -> torch.Tensor:
    master = local_view(master)
    if master.dtype != torch.float32:
        raise ValueError(f"a master weight is float32, got {master.dtype} of shape {tuple(master.shape)}")
    return master


def _check_pair(param: torch.Tensor, remainder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    param, remainder = local_view(param), local_view(remainder)
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16 or param.shape != remainder.shape:
        raise ValueError(f"a master is a bfloat16 parameter and an int16 remainder of one shape, got "
                         f"{param.dtype} {tuple(param.shape)} and {remainder.dtype} {tuple(remainder.shape)}")
    return param, remainder


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an fp32 master [*] into (bf16 [*], int16 remainder [*]) with ``join_master`` undoing it bitwise.

    The bf16 value is the master rounded to nearest, ties away from zero (module docstring: why not even).
    A DTensor is split as its local piece (plain tensors are returned).
    Raises:
        ValueError: ``master`` is not float32.
    """
    master = _check_master(master)
    hi, rem = _high_bits(master.view(torch.int32))
    return hi.to(torch.int16).view(torch.bfloat16), rem.to(torch.int16)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master [*] (a new tensor) whose split is (``param`` bf16 [*], ``remainder`` int16 [*]).

    DTensors are joined as their local pieces (a plain tensor is returned).
    Raises:
        ValueError: not a bf16 / int16 pair of one shape.
    """
    param, remainder = _check_pair(param, remainder)
    bits = param.view(torch.int16).to(torch.int32)
    bits.mul_(1 << 16).add_(remainder)  # sign-extended high half: (h << 16) + r is the int32 pattern
    return bits.view(torch.float32)


def split_master_(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """:func:`split_master` written into existing tensors: ``param`` (bf16) and ``remainder`` (int16).

    All three may be DTensors of one placement (each rank writes its local piece). Transient memory: three
    int32 tensors shaped like ``master``'s local piece.
    Raises:
        ValueError: dtypes other than float32 / bfloat16 / int16, or shapes that differ.
    """
    master = _check_master(master)
    param, remainder = _check_pair(param, remainder)
    if master.shape != param.shape:
        raise ValueError(f"master {tuple(master.shape)} and parameter {tuple(param.shape)} differ in shape")
    hi, rem = _high_bits(master.view(torch.int32))
    param.view(torch.int16).copy_(hi)
    remainder.copy_(rem)


def round_ties_away_(master: torch.Tensor, param: torch.Tensor) -> None:
    """Write ``master`` (fp32) rounded to nearest, ties away from zero, into ``param`` (bf16); DTensors as locals.

    The bf16 half of :func:`split_master`, for a parameter whose master is a whole fp32 copy, so that both
    master variants give the same parameter bits.
    Raises:
        ValueError: ``master`` not float32, ``param`` not bfloat16, or shapes that differ.
    """
    master, param = _check_master(master), local_view(param)
    if param.dtype != torch.bfloat16 or param.shape != master.shape:
        raise ValueError(f"round_ties_away_: bfloat16 {tuple(master.shape)} target expected, got "
                         f"{param.dtype} {tuple(param.shape)}")
    hi, _ = _high_bits(master.view(torch.int32))
    param.view(torch.int16).copy_(hi)


@dataclass(frozen=True)
class StorageOptions:
    """How the optimizer stores masters and states (Megatron-LM's precision-aware optimizer options).

    Attributes:
        exp_avg_dtype: storage of AdamW's ``exp_avg`` (and ``momentum_buffer`` of Muon), float32 or bfloat16.
        exp_avg_sq_dtype: storage of AdamW's ``exp_avg_sq`` (and ``max_exp_avg_sq``), float32 or bfloat16.
        store_param_remainders: a bf16 parameter's fp32 master is kept as an int16 remainder
            (``master_remainder``, 2 B per parameter) rather than an fp32 copy (``master_param``, 4 B).
    The state dtypes apply to float32 and bfloat16 parameters; states of other parameters (float64 in
    tests) keep the parameter's dtype.
    Raises:
        ValueError: a state dtype other than float32 / bfloat16.
    """

    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    store_param_remainders: bool = True

    def __post_init__(self) -> None:
        for field in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, field) not in DTYPES.values():
                raise ValueError(f"StorageOptions.{field} = {getattr(self, field)}: optimizer states are stored "
                                 "in torch.float32 or torch.bfloat16")

    @classmethod
    def from_precision(cls, precision: Any) -> StorageOptions:
        """From the recipe's ``precision`` section (``exp_avg_dtype``, ``exp_avg_sq_dtype``: "fp32" | "bf16";
        ``store_param_remainders``).

        Raises:
            ValueError: a dtype spelled other than "fp32" / "bf16" (names the field and the choices).
        """
        def dtype(field: str, value: str) -> torch.dtype:
            if value not in DTYPES:
                raise ValueError(f"precision.{field} = {value!r}: choose one of {', '.join(DTYPES)}")
            return DTYPES[value]

        return cls(dtype("exp_avg_dtype", precision.exp_avg_dtype),
                   dtype("exp_avg_sq_dtype", precision.exp_avg_sq_dtype), bool(precision.store_param_remainders))

    @property
    def master_key(self) -> str:
        """The state key of a bf16 parameter's master: ``master_remainder`` or ``master_param``."""
        return MASTER_REMAINDER if self.store_param_remainders else MASTER_PARAM

    def state_dtype(self, key: str, param: torch.Tensor) -> torch.dtype | None:
        """Storage dtype of state ``key`` of ``param`` (None: a key this policy leaves as loaded, e.g. ``step``)."""
        if key == MASTER_REMAINDER:
            return torch.int16
        if key == MASTER_PARAM:
            return torch.float32
        if key not in FIRST_MOMENT_KEYS + SECOND_MOMENT_KEYS:
            return None
        if param.dtype not in (torch.float32, torch.bfloat16):
            return param.dtype
        return self.exp_avg_dtype if key in FIRST_MOMENT_KEYS else self.exp_avg_sq_dtype

    def describe(self, params: list[torch.Tensor], state_keys: tuple[str, ...]) -> dict[str, str]:
        """{"master": "int16_remainder" | "fp32_copy" | "none", <state key>: dtype name} for a group's ``params``."""
        has_bf16 = any(p.dtype == torch.bfloat16 for p in params)
        out = {"master": ("int16_remainder" if self.store_param_remainders else "fp32_copy") if has_bf16 else "none"}
        for key in state_keys:
            dtypes = sorted({str(self.state_dtype(key, p)).removeprefix("torch.") for p in params})
            out[key] = ",".join(dtypes)
        return out


def storage_for(precision: Any) -> StorageOptions | None:
    """The optimizers' ``storage`` argument for a recipe's ``precision`` section: None (torch's own optimizers,
    unchanged) when ``params_dtype`` is fp32 and both states are fp32, else :meth:`StorageOptions.from_precision`.

    Raises:
        ValueError: as :meth:`StorageOptions.from_precision`.
    """
    storage = StorageOptions.from_precision(precision)
    if precision.params_dtype == "fp32" and storage.exp_avg_dtype == torch.float32 \
            and storage.exp_avg_sq_dtype == torch.float32:
        return None
    return storage


def check_param(param: torch.Tensor, storage: StorageOptions) -> None:
    """Refuse a parameter whose dtype the master scheme does not cover.

    Raises:
        ValueError: a float16 parameter (a bf16 split cannot hold its master; keep it fp32 or bf16).
    """
    if param.dtype == torch.float16:
        raise ValueError(f"precision-aware optimizer: a float16 parameter of shape {tuple(param.shape)}: masters "
                         "are kept for bfloat16 parameters only. Fix: store it as float32 or bfloat16.")


def store_in_bf16(param: torch.Tensor) -> None:
    """Store an fp32 parameter in bf16 in place (``param.data``), keeping its exact value for the optimizer.

    The bf16 value is the fp32 one rounded to nearest, ties away (:func:`split_master`); the remainder waits on
    the parameter (:data:`INITIAL_REMAINDER`, 2 B per element, the size of the master state it becomes) until
    :func:`ensure_master` makes it the master, or a loaded checkpoint's master replaces it
    (:func:`drop_initial_remainders`). Starting the master at the bf16 rounding instead would lose the fp32
    initialisation: early updates smaller than half a bf16 ulp then leave every weight the forward sees unchanged,
    while fp32 storage lets the first updates flip the roundings of the weights nearest a boundary (measured on
    the H200, 2026-12-04: lm loss 10.86 against 9.82 after the first step of bench_h200, the gap gone by step ~20;
    benchmarks/results/loss_curve_storage_h200_2026-12-04_*.md). Meta tensors are converted without a remainder.
    Raises:
        ValueError: ``param`` is not float32.
    """
    if param.device.type == "meta":
        param.data = param.data.to(torch.bfloat16)
        return
    low, remainder = split_master(param.data)
    param.data = low
    setattr(param, INITIAL_REMAINDER, remainder)


def drop_initial_remainders(params: Any) -> None:
    """Forget the initial remainders of ``params`` (the master comes from a checkpoint instead)."""
    for p in params:
        if hasattr(p, INITIAL_REMAINDER):
            delattr(p, INITIAL_REMAINDER)


def ensure_master(state: dict, param: torch.Tensor, storage: StorageOptions) -> None:
    """Create a bf16 parameter's master state, if absent: from the fp32 value it was stored from
    (:func:`store_in_bf16`), else from its bf16 value (remainder zeros). The initial remainder is dropped."""
    initial = getattr(param, INITIAL_REMAINDER, None)
    if initial is not None:
        delattr(param, INITIAL_REMAINDER)
    if param.dtype != torch.bfloat16 or MASTER_REMAINDER in state or MASTER_PARAM in state:
        return
    if initial is not None and initial.shape != local_view(param).shape:
        initial = None  # the parameter was resharded since: its value is all that is known
    elif initial is not None:
        initial = initial.to(local_view(param).device)  # the model moved after it was stored (a no-op if not)
    if storage.store_param_remainders:
        state[MASTER_REMAINDER] = (initial if initial is not None else
                                   torch.zeros_like(param, dtype=torch.int16, memory_format=torch.preserve_format))
    else:
        state[MASTER_PARAM] = (join_master(param, initial) if initial is not None
                               else param.detach().to(torch.float32, copy=True))


def master_work(param: torch.Tensor, state: dict) -> torch.Tensor:
    """The fp32 (or the parameter's own dtype) local tensor the step updates in place for ``param``.

    A non-bf16 parameter: its own local piece. An fp32 copy: that copy's local piece. A remainder: a new fp32
    tensor joined from the parameter and the remainder (written back by :func:`store_master`).
    """
    if param.dtype != torch.bfloat16:
        return local_view(param)
    if MASTER_PARAM in state:
        return local_view(state[MASTER_PARAM])
    return join_master(param, state[MASTER_REMAINDER])


def store_master(param: torch.Tensor, state: dict, work: torch.Tensor) -> None:
    """Write an updated master back: bf16 parameter + remainder, or (fp32 copy already updated) the parameter."""
    if param.dtype != torch.bfloat16:
        return
    if MASTER_PARAM in state:
        round_ties_away_(work, param)
    else:
        split_master_(work, param, state[MASTER_REMAINDER])


def upcast(t: torch.Tensor) -> torch.Tensor:
    """The local piece of a state or gradient, in fp32 when stored in bf16 (a new tensor), else itself."""
    t = local_view(t)
    return t.float() if t.dtype == torch.bfloat16 else t


def store_state(stored: torch.Tensor, work: torch.Tensor) -> None:
    """Write an fp32 working state back into its storage (bf16: rounded to nearest even); a no-op if it is it."""
    target = local_view(stored)
    if work is not target:
        target.copy_(work)


def restore_loaded_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict, storage: StorageOptions) -> None:
    """After ``Optimizer.load_state_dict``: re-take each state tensor from ``state_dict`` in its storage dtype.

    ``torch.optim.Optimizer.load_state_dict`` casts every floating parameter's state to the parameter's
    dtype, which would round an fp32 master copy or a state to bf16 and turn an int16 remainder into bf16.
    Parameters are matched as torch does (saved groups' ``params`` against current groups, in order).
    Raises:
        ValueError: a bf16 parameter's loaded state lacks its master (``master_remainder`` /
            ``master_param`` as ``store_param_remainders`` says): the checkpoint was written with another
            storage; resume it with the precision its manifest records.
    """
    saved = [k for g in state_dict["param_groups"] for k in g["params"]]
    current = [p for g in optimizer.param_groups for p in g["params"]]
    for key, param in zip(saved, current):
        loaded = state_dict["state"].get(key)
        if not loaded:
            continue
        state = optimizer.state[param]
        for name, value in loaded.items():
            dtype = storage.state_dtype(name, param) if torch.is_tensor(value) else None
            if dtype is not None:
                state[name] = value.to(device=param.device, dtype=dtype)
        if param.dtype == torch.bfloat16 and storage.master_key not in loaded:
            raise ValueError(f"optimizer state of bf16 parameter {key!r} has no {storage.master_key!r} (keys: "
                             f"{sorted(loaded)}): it was saved with another master storage. Fix: resume with the "
                             "precision.params_dtype / store_param_remainders the checkpoint's manifest records.")

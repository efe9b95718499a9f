"""Activation offload (``parallel.cpu_offloading``): the layer inputs whole-layer recompute keeps, in host memory.

Under ``recompute_granularity: full`` (``model/parallel/recompute.py``) each decoder block and MTP layer runs its
``forward`` under a non-reentrant ``torch.utils.checkpoint``, and the only tensors it keeps for backward are its
inputs: the streams ``h`` [T, hc, dim] (and the int64 token ids [T], a few bytes per token). This module moves
those streams to pinned host memory while the forward goes on, and brings them back ahead of the layer's backward.
Source: torch's ``torch.autograd.graph.saved_tensors_hooks`` and ``save_on_cpu`` (the same pack / unpack pair,
here with a side stream and a prefetch); Megatron-LM's ``TransformerConfig.cpu_offloading`` (done there by
Transformer Engine's ``get_cpu_offload_context``, saved-tensor hooks too, per layer).

How: every block takes a subclass of its own class whose ``forward`` calls the original under
``saved_tensors_hooks(pack, unpack)`` (the class swap of recompute.py and FSDP2: FQNs and state-dict keys are
unchanged). Around a non-reentrant checkpoint those hooks see exactly the checkpoint's tensor inputs, once; the
layer's own activations go to the checkpoint's inner hooks and are recomputed in backward.

* pack (forward): a CUDA tensor that is a plain ``torch.Tensor`` (not a DTensor or other subclass), floating,
  contiguous and at least ``min_bytes`` large is copied into a pinned host buffer on a side stream (which first
  waits for the current stream), ``non_blocking``; ``record_stream`` keeps the caching allocator from reusing the
  GPU memory until that copy has run, so the GPU tensor is freed as soon as the forward drops it. Other tensors
  (token ids, small ones, CPU ones, leaves that require grad such as parameters) are kept as they are.
* unpack (backward): the tensor on its device. The first unpack of a block call's tensors starts the copy back of
  the tensors of the block call that ran before it in the same forward pass (the one backward reaches next), on
  the side stream, into memory allocated on the current stream; unpack itself makes the current stream wait for
  its tensor's copy event (``wait_event``) instead of copying synchronously. A tensor that was not prefetched
  (the last layer of a forward pass, or a second backward through a retained graph) is copied when it is
  unpacked ("late").
* forward passes are chained by block order within a part: a block call follows the previous block call only
  when that call was made by the block before it in the same part (``decoder_blocks`` order: layers, then MTP).
  A part's forward runs its blocks back to back, so with a pipeline schedule (several micro-batches in flight,
  several parts per rank) each micro-batch's chain stays its own.

Composes with FSDP2 (its hooks run around the block's ``forward``, so around these), with torch.compile'd
recompute regions (``recompute.COMPILED_REGIONS``: the compiled body runs inside the checkpoint, inside these
hooks), and with pipeline stages (apply per part after the split). Not with CUDA graphs: a pack inside a capture
raises. The GPU memory freed per layer is its input streams; the GPU holds at most the input of the layer
backward re-runs and the one prefetched after it.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Optional

import torch
from torch import nn

from .fsdp import decoder_blocks

__all__ = ["MIN_BYTES", "OffloadStats", "apply_activation_offload", "offload_stats", "offloaded_blocks",
           "reset_offload_stats"]

MIN_BYTES = 1 << 20
"""Smallest tensor (bytes) moved to host: below it a copy costs more in launch and sync than it frees."""

_SLOT = "_v4_offload_slot"
"""Instance attribute of an offloaded block: its :class:`_Slot` (position in its part, settings)."""
_INPUT_SLOT = "_v4_offload_input_slot"
"""Instance attribute of an offloaded MTP layer: the :class:`_Slot` of its ``mtp_input`` call (before its block)."""


@dataclasses.dataclass
class OffloadStats:
    """What the offload did since the last :func:`reset_offload_stats` (process-wide, every device).

    Attributes (bytes are those of the tensors' elements):
        forwards: forward passes seen (chains of block calls; one per part forward under a pipeline).
        offloaded_tensors, offloaded_bytes: tensors copied to host, and their bytes, in all forwards.
        last_forward_bytes: bytes copied to host by the latest forward pass.
        kept_tensors: tensors the hooks saw and left where they were (token ids, small, CPU, subclasses).
        host_bytes: host bytes the offloaded tensors hold now (freed when autograd drops them after backward).
        peak_host_bytes: the most host bytes held at once.
        prefetched: copies back started ahead of the tensor's unpack (by the unpack of the next block call).
        late: copies back started by the tensor's own unpack (no block call after it in its forward pass).
        waited: prefetched copies not yet finished when unpacked (the current stream waited on them; CUDA only).
    """

    forwards: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    last_forward_bytes: int = 0
    kept_tensors: int = 0
    host_bytes: int = 0
    peak_host_bytes: int = 0
    prefetched: int = 0
    late: int = 0
    waited: int = 0


_STATS = OffloadStats()


def offload_stats() -> OffloadStats:
    """A snapshot of the process's :class:`OffloadStats`."""
    return dataclasses.replace(_STATS)


def reset_offload_stats() -> None:
    """Zero the counters; ``host_bytes`` stays (tensors still held), and the peak restarts from it."""
    held = _STATS.host_bytes
    _STATS.__dict__.update(dataclasses.asdict(OffloadStats(host_bytes=held, peak_host_bytes=held)))


@dataclasses.dataclass(frozen=True, eq=False)
class _Slot:
    """A block's place in its part (``part`` is one token per :func:`apply_activation_offload` call) and settings."""

    part: object
    index: int
    min_bytes: int
    cpu: bool
    late: bool = False


class _Group:
    """The tensors one block call packed (weakly: autograd owns them) and the block call before it in its forward."""

    __slots__ = ("slot", "prev", "items", "fetched", "__weakref__")

    def __init__(self, slot: _Slot, prev: Optional["_Group"]):
        self.slot, self.prev, self.items, self.fetched = slot, prev, [], False


class _Packed:
    """One offloaded tensor: its host copy, and its device copy while one is in flight or not yet unpacked."""

    __slots__ = ("group", "device", "host", "dev", "event", "__weakref__")

    def __init__(self, group: _Group, device: torch.device, host: torch.Tensor):
        self.group, self.device, self.host, self.dev, self.event = group, device, host, None, None
        _STATS.host_bytes += host.nbytes
        _STATS.peak_host_bytes = max(_STATS.peak_host_bytes, _STATS.host_bytes)

    def __del__(self):
        if _STATS is not None:  # None at interpreter teardown
            _STATS.host_bytes -= self.host.nbytes


class _Engine:
    """The process's side streams (one per device) and the latest block call (the chain's tail)."""

    def __init__(self):
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.last: Optional[_Group] = None

    def side(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.streams:
            self.streams[index] = torch.cuda.Stream(device=index)
        return self.streams[index]

    def begin(self, slot: _Slot) -> _Group:
        """A new block call: it follows the latest one when that was the previous block of the same part."""
        last = self.last
        follows = last is not None and last.slot.part is slot.part and last.slot.index == slot.index - 1
        if not follows:
            _STATS.forwards += 1
            _STATS.last_forward_bytes = 0
        prev = last if follows else None
        if prev is not None and prev.slot.late:  # not prefetched: the block after it links past it
            prev = prev.prev
        self.last = _Group(slot, prev)
        return self.last

    def pack(self, group: _Group, t: torch.Tensor):
        if not _offloadable(t, group.slot):
            _STATS.kept_tensors += 1
            return t
        if t.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "activation offload (parallel.cpu_offloading=true) cannot run inside a CUDA-graph capture: its "
                    "host copies, side stream and events are not captured. Fix: set parallel.cpu_offloading=false, "
                    "or compile.cuda_graph=false for this run.")
            main, side = torch.cuda.current_stream(t.device), self.side(t.device)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            side.wait_stream(main)  # t is written by work queued on the current stream
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # its memory is not reused before the copy has read it
        else:  # CPU tensors (tests): a separate buffer, so unpack really returns a copy
            host = torch.empty_like(t).copy_(t)
        rec = _Packed(group, t.device, host)
        group.items.append(weakref.ref(rec))
        _STATS.offloaded_tensors += 1
        _STATS.offloaded_bytes += t.nbytes
        _STATS.last_forward_bytes += t.nbytes
        return rec

    def unpack(self, rec):
        if isinstance(rec, torch.Tensor):
            return rec
        if rec.dev is None:
            self._copy_back(rec)
            _STATS.late += 1
        elif rec.event is not None and not rec.event.query():
            _STATS.waited += 1
        rec.group.fetched = True
        self._prefetch(rec.group.prev)
        dev, event = rec.dev, rec.event
        rec.dev = rec.event = None  # autograd owns the device copy now; another unpack copies again
        if event is not None:
            torch.cuda.current_stream(dev.device).wait_event(event)
        return dev

    def _prefetch(self, group: Optional[_Group]) -> None:
        """Start the copy back of every live tensor of ``group`` (once per group)."""
        if group is None or group.fetched:
            return
        group.fetched = True
        for ref in group.items:
            rec = ref()
            if rec is not None and rec.dev is None:
                self._copy_back(rec)
                _STATS.prefetched += 1

    def _copy_back(self, rec: _Packed) -> None:
        """``rec.dev`` := a device copy of ``rec.host``, in flight on the side stream until ``rec.event``."""
        if rec.device.type != "cuda":
            rec.dev = rec.host.clone()
            return
        main, side = torch.cuda.current_stream(rec.device), self.side(rec.device)
        dev = torch.empty(rec.host.shape, dtype=rec.host.dtype, device=rec.device)  # the current stream's pool
        side.wait_stream(main)  # the memory may have been freed by work still queued there
        with torch.cuda.stream(side):
            dev.copy_(rec.host, non_blocking=True)
            rec.event = side.record_event()
        dev.record_stream(side)  # freed unused (graph dropped): not reused before the copy has written it
        rec.dev = dev


_ENGINE = _Engine()


def _offloadable(t: torch.Tensor, slot: _Slot) -> bool:
    """A tensor worth moving: plain, floating, contiguous, on CUDA (or the CPU when ``slot.cpu``), large enough, and
    not a leaf that requires grad (a parameter, or a pipeline stage's received input: its owner keeps it alive, so
    moving it would free nothing)."""
    on = t.is_cuda or (slot.cpu and t.device.type == "cpu")
    return (on and type(t) is torch.Tensor and t.is_floating_point() and t.is_contiguous()
            and not (t.is_leaf and t.requires_grad)
            and t.numel() > 0 and t.nbytes >= slot.min_bytes)


def _offloading(base_forward, slot_key: str = _SLOT):
    """``forward`` (or an MTP layer's ``mtp_input``) that runs ``base_forward`` under the engine's saved-tensor
    hooks (grad mode only), as the call of the slot at ``slot_key``."""

    @functools.wraps(base_forward)
    def forward(self, *args, **kwargs):
        slot = self.__dict__.get(slot_key)
        if slot is None or not torch.is_grad_enabled():
            return base_forward(self, *args, **kwargs)
        group = _ENGINE.begin(slot)
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_ENGINE.pack, group), _ENGINE.unpack):
            return base_forward(self, *args, **kwargs)

    return forward


_OFFLOAD_CLASSES: dict[type, type] = {}


def _offload_class(cls: type) -> type:
    """``cls`` with its ``forward`` under the hooks; one class per base, shared by every instance."""
    if getattr(cls, "_v4_offload", False):
        return cls
    if cls not in _OFFLOAD_CLASSES:
        namespace = {"_v4_offload": True, "forward": _offloading(cls.forward), "__module__": __name__}
        if hasattr(cls, "mtp_input"):  # an MTP layer: its input projections' saved tensors go to host too
            namespace["mtp_input"] = _offloading(cls.mtp_input, _INPUT_SLOT)
        _OFFLOAD_CLASSES[cls] = type(f"Offload{cls.__name__}", (cls,), namespace)
    return _OFFLOAD_CLASSES[cls]


def apply_activation_offload(part: nn.Module, *, min_bytes: int = MIN_BYTES, cpu_tensors: bool = False,
                             mtp_inputs: bool = True) -> list[str]:
    """Offload the inputs every decoder block and MTP layer of ``part`` keeps under whole-layer recompute, and the
    tensors an MTP layer's ``mtp_input`` (enorm, hnorm, e_proj / h_proj) saves for backward.

    Args:
        part: a ``V4Model`` or a pipeline stage cut from one, after ``apply_recompute(part, ["full"])``; before or
            after ``compile_blocks`` and FSDP2's ``fully_shard``.
        min_bytes: smallest tensor moved (bytes; default :data:`MIN_BYTES`, 1 MiB).
        cpu_tensors: also move CPU tensors (into a separate CPU buffer, with the same chain and counts): for tests
            on machines without a GPU.
        mtp_inputs: also move what each MTP layer's ``mtp_input`` saves (its call runs under the hooks as one more
            link of the chain, before the layer's block; the memory plan counts it, ``mtp_input_bytes_per_token``).
            Those tensors are not prefetched: each comes back when its own unpack asks for it, after the MTP block's
            re-run, so they never sit on the GPU beside it (the MTP block prefetches the layer before mtp_input).
    Returns:
        The FQNs of the blocks whose forward runs under the hooks (``layers.0`` ... ``mtp.0``), in forward order;
        empty when ``part`` holds no block.
    Raises:
        ValueError: a block of ``part`` is not under whole-layer recompute: without it the hooks would move every
            activation the layer saves (its own code would then wait on host copies), so it is refused, naming
            ``parallel.recompute_granularity`` and the fix.
    Effects: parameters, buffers, FQNs and state-dict keys are unchanged; forward values and gradients are
        unchanged (the copies are exact). Applying twice is harmless (the second call renews the chain slots).
    """
    blocks = decoder_blocks(part)
    names = {id(m): n for n, m in part.named_modules()}
    for block in blocks:
        if "forward" not in getattr(type(block), "_v4_recompute_attrs", ()):
            raise ValueError(
                f"parallel.cpu_offloading=true: layer {names.get(id(block), block.layer_id)} is not under whole-layer "
                "recompute, and activation offload moves only the inputs a recomputed layer keeps "
                "(parallel.recompute_granularity is not full). Fix: set parallel.recompute_granularity=full "
                "parallel.recompute_modules=[] (apply_recompute(part, ['full']) before apply_activation_offload), "
                "or parallel.cpu_offloading=false.")
    token = object()
    index = 0  # forward order: layers, then per MTP layer its mtp_input call and its block
    for block in blocks:
        if mtp_inputs and hasattr(block, "mtp_input"):
            # copied back at its own unpack, after the MTP block's backward: prefetched, it would sit on the GPU
            # beside that block's re-run, the MTP layer's peak
            block.__dict__[_INPUT_SLOT] = _Slot(token, index, min_bytes, cpu_tensors, late=True)
            index += 1
        else:
            block.__dict__.pop(_INPUT_SLOT, None)
        block.__dict__[_SLOT] = _Slot(token, index, min_bytes, cpu_tensors)
        block.__class__ = _offload_class(type(block))
        index += 1
    return [names[id(b)] for b in blocks]


def offloaded_blocks(part: nn.Module) -> list[str]:
    """FQNs of the blocks of ``part`` whose inputs are offloaded, in module order."""
    return [n for n, m in part.named_modules() if getattr(type(m), "_v4_offload", False) and _SLOT in m.__dict__]

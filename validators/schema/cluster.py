"""``cluster:`` section: hardware the run targets (GPU model → SM version, node shape)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, computed_field

from .base import Section
from .limits import MAX_DEGREE, MAX_GPUS_PER_NODE

GpuModel = Literal["cpu", "A100", "L40S", "H100", "H200", "GH200", "B200", "GB200", "B300", "GB300", "RTX5090"]

GPU_SM: dict[str, int | None] = {
    "cpu": None, "A100": 80, "L40S": 89, "H100": 90, "H200": 90, "GH200": 90,
    "B200": 100, "GB200": 100, "B300": 103, "GB300": 103, "RTX5090": 120,
}
"""Compute capability (major*10 + minor) of each GPU model; None for CPU-only runs."""

GPU_MEMORY_GIB: dict[str, float] = {
    "cpu": 0.0, "A100": 80.0, "L40S": 48.0, "H100": 80.0, "H200": 139.8, "GH200": 96.0,
    "B200": 180.0, "GB200": 186.0, "B300": 288.0, "GB300": 288.0, "RTX5090": 32.0,
}
"""Device memory per GPU model (GiB), used when cluster.gpu_memory_gib is not set. H200: what torch reports
(``get_device_properties(0).total_memory`` = 139.8 GiB on the H200s the calibration ran on; the data sheet's
141 GB are decimal). The others are data-sheet figures, not yet read off a device."""

GPU_PEAK_BF16_TFLOPS: dict[str, float] = {
    "A100": 312.0, "L40S": 362.0, "H100": 989.4, "H200": 989.4, "GH200": 989.4,
    "B200": 2250.0, "GB200": 2500.0, "B300": 2250.0, "GB300": 2500.0, "RTX5090": 209.5,
}
"""Data-sheet dense bf16 tensor-core peak per GPU (TFLOPS, without sparsity). The time plan
(``validators/time_plan.py``) scales the throughput it measured on the H200 by the ratio of these peaks: it
assumes a GPU reaches the same fraction of its own peak as the H200 did (not measured on any other GPU)."""

GPU_INTERCONNECT_GB_S: dict[str, tuple[float, float]] = {
    "A100": (300.0, 25.0), "L40S": (32.0, 25.0), "H100": (450.0, 50.0), "H200": (450.0, 50.0),
    "GH200": (450.0, 50.0), "B200": (900.0, 50.0), "GB200": (900.0, 50.0), "B300": (900.0, 100.0),
    "GB300": (900.0, 100.0), "RTX5090": (64.0, 50.0),
}
"""(intra-node, inter-node) GB/s per GPU and direction when ``cluster.intra_node_gb_per_s`` /
``inter_node_gb_per_s`` are null: the link ratings of the reference nodes (NVLink 3 / 4 / 5: 600 / 900 / 1800
GB/s both ways; PCIe 4 / 5 x16 for L40S / RTX5090; one 200 Gb/s (A100, L40S), 400 Gb/s (Hopper, B200) or
800 Gb/s (B300) network port per GPU). Collectives reach less than a link's rating (NCCL's bus bandwidth
is typically 70-85% of it): measure yours (nccl-tests) and set the fields."""


class ClusterConfig(Section):
    """Target hardware. world size = nodes · gpus_per_node (CPU: processes per node)."""

    gpu: GpuModel = Field("H200", description="GPU model; decides the SM version the kernel gates check.")
    nodes: int = Field(1, ge=1, le=MAX_DEGREE, description="Nodes.")
    gpus_per_node: int = Field(8, ge=1, le=MAX_GPUS_PER_NODE, description="GPUs (or, for gpu=cpu, processes) per node.")
    gpu_memory_gib: float | None = Field(None, gt=0, le=1 << 20, description="Memory per GPU (GiB); null = the model's catalogue value.")
    intra_node_gb_per_s: float | None = Field(None, gt=0, le=1e5, description="Bandwidth per GPU, one direction, between GPUs of one node, in GB/s (10^9 bytes/s, not bits): what the time plan divides the node-local bytes of EP all-to-all, CP exchange and FSDP collectives by. null = the GPU model's link rating (H200: 450, B200: 900).")
    inter_node_gb_per_s: float | None = Field(None, gt=0, le=1e5, description="Bandwidth per GPU, one direction, between nodes, in GB/s (bytes, not bits: one 400 Gb/s port per GPU is 50): what the time plan divides the bytes bound for other nodes by. null = the GPU model's default (H200, B200: 50).")
    host_memory_gib: float | None = Field(None, gt=0, le=1 << 24, description="Host RAM per node (GiB) the job may use; the memory plan checks the node's ranks against it (pinned offload buffers, per-process memory). null = not checked, the plan still prints the need.")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def sm(self) -> int | None:
        """Compute capability as major*10+minor (90 = Hopper), None on CPU."""
        return GPU_SM[self.gpu]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def world_size(self) -> int:
        """Total ranks: nodes · gpus_per_node."""
        return self.nodes * self.gpus_per_node

"""``optimizer:``, ``data:``, ``checkpointing:``, ``logging:`` and ``run:`` sections."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from .base import Section
from .limits import MAX_LIST_ITEMS, MAX_SEED, MAX_STEPS, MAX_TEXT_CHARS, MAX_TOKENS

Beta = Annotated[float, Field(ge=0, lt=1)]
"""An Adam beta: a decay factor in [0, 1) (1 or more never forgets, or diverges)."""


class OptimizerConfig(Section):
    """Muon for matrices, AdamW for embeddings, head, norms, biases and mHC gates (paper §training)."""

    name: Literal["muon_adamw", "adamw"] = Field("muon_adamw", description="muon_adamw: Muon for 2-D hidden weights + AdamW for the rest; adamw: AdamW everywhere.")
    lr: float = Field(3e-4, gt=0, le=1, description="Peak learning rate (AdamW groups; Muon groups use muon_lr), in (0, 1]; write a number (3e-4), not text.")
    muon_lr: float = Field(2e-2, gt=0, le=1, description="Peak learning rate of Muon parameter groups.")
    min_lr: float = Field(3e-5, ge=0, le=1, description="Final learning rate of the decay, in [0, optimizer.lr].")
    weight_decay: float = Field(0.1, ge=0, le=1, description="Decoupled weight decay (matrices only).")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW betas [beta1, beta2], each in [0, 1).")
    eps: float = Field(1e-8, gt=0, le=1, description="AdamW epsilon.")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon momentum.")
    warmup_steps: int = Field(100, ge=0, le=MAX_STEPS, description="Linear LR warm-up (optimizer steps) at the start of the run.")
    schedule: Literal["cosine", "constant", "wsd"] = Field("cosine", description="LR decay shape over the whole curriculum.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: fraction of total steps spent decaying.")
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="Global gradient-norm clip; 0 disables.")

    @model_validator(mode="after")
    def _min_lr_below_peak(self) -> "OptimizerConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"optimizer.min_lr = {self.min_lr:g} is above optimizer.lr = {self.lr:g}: the decay would "
                             f"raise the learning rate; set optimizer.min_lr <= {self.lr:g} (e.g. {self.lr / 10:g})")
        return self


class BlendSource(Section):
    """One megatron-core dataset of a blend (Megatron-LM ``--data-path WEIGHT PREFIX``)."""

    weight: float = Field(..., gt=0, le=1e6, description="Relative sampling weight (normalised over the blend).")
    prefix: str = Field(..., min_length=1, max_length=MAX_TEXT_CHARS, description="Path prefix of an existing megatron-core indexed dataset (PREFIX.bin / PREFIX.idx).")


class DataConfig(Section):
    """Training text → megatron-core indexed dataset (.bin/.idx) → packed THD micro-batches."""

    source: Literal["python_stdlib", "files", "blend"] = Field("python_stdlib", description="python_stdlib: the interpreter's own standard-library sources (on every machine); files: 'paths'; blend: the existing megatron-core datasets of 'blend'.")
    paths: tuple[str, ...] = Field((), max_length=MAX_LIST_ITEMS, description="Text (.txt, any plain file) or .jsonl files / directories when source=files.")
    jsonl_key: str = Field("text", max_length=MAX_TEXT_CHARS, description="Field holding the document text in .jsonl inputs.")
    blend: tuple[BlendSource, ...] = Field((), max_length=MAX_LIST_ITEMS, description="source=blend: [{weight, prefix}, ...] existing megatron-core datasets sampled by weight (Megatron-LM --data-path w1 p1 w2 p2).")
    tokenizer: Literal["byte"] | Annotated[str, Field(pattern=r"\.json$", max_length=MAX_TEXT_CHARS)] = Field("byte", description="byte: UTF-8 bytes + end-of-document token (vocab 257+); or the path of a Hugging Face tokenizer.json (its tokenizer_config.json names the eos_token that ends each document).")
    prefix: str | None = Field(None, max_length=MAX_TEXT_CHARS, description="Path prefix of a prepared indexed dataset; null = prepare into the workspace cache.")
    max_documents: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Cap on documents taken from the source.")
    validation_fraction: float = Field(0.02, ge=0, lt=1, description="Share of documents held out for evaluation.")
    seed: int = Field(1234, ge=0, le=MAX_SEED, description="Seed of the document order, in [0, 2^32 - 1] (numpy's seed range).")
    packing: Literal["whole_documents", "fill_rows"] = Field("whole_documents", description=(
        "How training rows are filled. whole_documents: a document that does not fit the rest of a row starts "
        "the next row, and the rest is padding (no document is cut, except one longer than a row; the padding "
        "is computed and wasted: 6% of the tokens, up to half of a step's, for the Python sources at 2 x 4,096). "
        "fill_rows: its head fills the row and its rest starts the next row as a segment of its own (no "
        "padding except at an epoch's end; a cut document loses the context before the cut). Evaluation "
        "always packs whole documents."))

    @model_validator(mode="after")
    def _blend_with_source(self) -> "DataConfig":
        if (self.source == "blend") != bool(self.blend):
            raise ValueError("data.blend lists the datasets of data.source=blend and only then: set data.source=blend "
                             "and give data.blend: [{weight: W, prefix: P}, ...], or leave data.blend out"
                             f" (now data.source={self.source}, {len(self.blend)} blend entries)")
        if self.source == "files" and not self.paths:
            raise ValueError("data.source=files reads the files and directories of data.paths, which is empty: "
                             "give data.paths: [text, .jsonl files or directories], or data.source=python_stdlib")
        return self

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _tokenizer_kind(cls, value: object) -> object:
        if isinstance(value, str) and value != "byte" and not value.endswith(".json"):
            raise ValueError(f"data.tokenizer = {value!r} is neither 'byte' nor the path of a Hugging Face "
                             "tokenizer.json: write byte, or a path ending in .json (e.g. tokenizers/v4/tokenizer.json)")
        return value


class CheckpointConfig(Section):
    """torch.distributed.checkpoint saves with a manifest; atomic (written aside, renamed into place)."""

    interval_steps: int = Field(100, ge=1, le=MAX_STEPS, description="Save every N optimizer steps (and at each stage end).")
    keep_last: int = Field(3, ge=1, le=10_000, description="Complete checkpoints kept; older ones are deleted after a successful save.")


class WandbConfig(Section):
    """Weights & Biases: the scalars TensorBoard gets, logged from rank 0 (the optional extra ``wandb``)."""

    project: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, description="W&B project the run is logged to (wandb.init(project=...)).")
    name: str | None = Field(None, min_length=1, max_length=MAX_TEXT_CHARS, description="W&B run name; null = the run directory's name.")
    mode: Literal["online", "offline", "disabled"] = Field("online", description=(
        "online: sync as the run goes (needs network and a login: `wandb login` or WANDB_API_KEY); offline: "
        "write the W&B files under the run directory's wandb/ only (`wandb sync` uploads them later); "
        "disabled: log nothing (the package is not needed)."))


class LoggingConfig(Section):
    """Metrics to JSONL (always), TensorBoard (optional), Weights & Biases (optional) and the rich console."""

    interval_steps: int = Field(1, ge=1, le=MAX_STEPS, description="Log every N optimizer steps.")
    tensorboard: bool = Field(True, description="Also write TensorBoard event files.")
    eval_interval_steps: int = Field(0, ge=0, le=MAX_STEPS, description=(
        "Also evaluate the held-out LM loss after every N-th step of each stage (counted within the stage, so a "
        "resumed run evaluates at the same steps); 0 = only at each stage end (always done). Each evaluation is "
        "a forward over the same 8 held-out micro-batches (micro_batch_size x seq_len rows each, at least one "
        "per data-parallel replica): about ceil(8 / dp) / (3 x accum) of a step's time, no extra memory "
        "(validators/eval_cost.py). Megatron's eval_interval."))
    plot: bool = Field(True, description=(
        "Write plot.png (the picture `v4launch plot` draws: losses, held-out losses, aux losses, tokens/s, "
        "memory) into the run directory at each stage end, on rank 0 (about a second; needs matplotlib: "
        "pip install 'v4launch[plot]'; without it the job logs a warning and goes on)."))
    wandb: WandbConfig | None = Field(None, description=(
        "Also log to Weights & Biases: {project, name, mode}; null (the default) = not at all. Needs the "
        "package (pip install 'v4launch[wandb]') unless mode is disabled; validate checks (V4-WANDB-INSTALLED)."))


class CompileConfig(Section):
    """Regional ``torch.compile`` of the decoder blocks and MTP layers (torchtitan's ``compile`` section)."""

    enable: bool = Field(False, description="torch.compile each decoder block and MTP layer (model/compile.py); a region under recompute is compiled inside its checkpoint. Costs compile time at the start and at each phase or kernel change.")
    backend: Literal["inductor", "aot_eager"] = Field("inductor", description="inductor: generated kernels (Triton on GPUs, C++ on CPUs: needs a C++ compiler); aot_eager: traces forward and backward, runs them eagerly (checks the tracing, no speed-up).")
    cuda_graph: bool = Field(False, description=(
        "Capture each micro-batch's forward and backward in one CUDA graph per stage and replay it (no host "
        "work per launch: the step stops being host-bound). Batches get static shapes (T segment rows, seq_len "
        "as the length bound, T / ratio compressed entries). One GPU per model replica: pp, cp and ep 1, no "
        "distributed optimizer; data parallelism is fine (gradients are reduced after the replay). bf16. With "
        "compile.enable the compiled blocks are captured too (the fastest setting on one GPU). Warm-up "
        "stages with the dense KL target and stages on the reference or cudnn kernels run without a graph "
        "(validate names them)."))


class RunConfig(Section):
    """Run identity and reproducibility."""

    output_root: str = Field("runs", min_length=1, max_length=MAX_TEXT_CHARS, description="Directory (relative to the workspace) holding run directories.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of parameter init and any sampling, in [0, 2^32 - 1] (numpy's seed range).")
    deterministic: bool = Field(True, description=(
        "Deterministic algorithms: bitwise-reproducible runs and resumes on CPU, and on a GPU with "
        "attention.kernel_backend: reference; the triton kernels add gradients with atomics (reproducible "
        "to rounding)."))
    threads: int | None = Field(None, ge=1, le=4096, description="torch intra-op threads per rank; null = torch default.")
    gc_interval_steps: int = Field(0, ge=0, le=1_000_000, description=(
        "Python's garbage collector: automatic collection off while training, the young generations collected "
        "every this many optimizer steps and a full collection at stage ends and before checkpoints (a full "
        "collection pauses the host for 100-300 ms, a slow step at an unpredictable point; on many ranks it "
        "stalls them all). 0 (the default): Python's automatic collection (with full rows it caused no slow step "
        "on the H200 bench recipe); try it for many-rank runs with compile.cuda_graph."))

"""DeepSeek-V4 reference model in plain PyTorch (spec: reference/v4-model-spec.md).

Public API (stable; the training job imports only these names)::

    from v4launch.model import ModelArgs, V4Model, ModelOutput, Phase
    model = V4Model(args, phase="dense")         # "dense" | "warmup" | "sparse"
    model.set_phase("warmup")                    # forward only; builds indexers when leaving "dense"
    out = model(tokens, cu_seqlens, max_seqlen, labels)   # THD packed batch
    out.lm_loss, out.aux_losses, out.logits
    model.update_router_bias(speed)              # aux-loss-free balancing step

Auxiliary loss names (raw, unscaled; see ``model.py`` for the definitions):
``indexer_kl/layer_NN``, ``balance/layer_NN``, ``mtp/depth_K``.
"""

from .args import ModelArgs
from .model import AUX_LOSS_DOC, ModelOutput, Phase, V4Model

__all__ = ["ModelArgs", "V4Model", "ModelOutput", "Phase", "AUX_LOSS_DOC"]

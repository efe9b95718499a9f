"""Training data: tokenizer, megatron-core indexed dataset preparation, THD packing."""

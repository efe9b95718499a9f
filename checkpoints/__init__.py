"""checkpoints"""

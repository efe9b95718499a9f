"""`v4launch resume` (being written)."""

HELP = "resume (not yet available)"
EXAMPLES = ""


def resume() -> None:
    """Not yet available."""
    raise NotImplementedError("v4launch resume is not implemented yet")

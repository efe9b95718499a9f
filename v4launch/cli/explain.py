"""`v4launch explain` (being written)."""

HELP = "explain (not yet available)"
EXAMPLES = ""


def explain() -> None:
    """Not yet available."""
    raise NotImplementedError("v4launch explain is not implemented yet")

"""`v4launch submit` (being written)."""

HELP = "submit (not yet available)"
EXAMPLES = ""


def submit() -> None:
    """Not yet available."""
    raise NotImplementedError("v4launch submit is not implemented yet")

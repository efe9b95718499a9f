"""`v4launch cancel` (being written)."""

HELP = "cancel (not yet available)"
EXAMPLES = ""


def cancel() -> None:
    """Not yet available."""
    raise NotImplementedError("v4launch cancel is not implemented yet")

"""`v4launch status` (being written)."""

HELP = "status (not yet available)"
EXAMPLES = ""


def status() -> None:
    """Not yet available."""
    raise NotImplementedError("v4launch status is not implemented yet")
